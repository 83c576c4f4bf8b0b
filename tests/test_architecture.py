"""The package's shape: imports flow one way, config loads no torch, every strategy is declared
completely, in one place."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path
from typing import get_args

import pytest

from harness import config, markers, strategies
from harness.strategies.base import LayoutOption, Strategy

HARNESS = Path(__file__).resolve().parents[1] / "harness"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _imported_names(tree: ast.Module, module: str, is_package: bool, modules: Collection[str]) -> set[str]:
    """Every module named by an import statement anywhere in the file (inside functions too),
    but for ``if TYPE_CHECKING:`` blocks, which never run."""
    names: set[str] = set()
    skipped = {id(n) for block in ast.walk(tree) if _is_type_checking_block(block) for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from package import module`` imports the module; ``from module import name`` the module.
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        imported = _imported_names(ast.parse(path.read_text()), module, path.name == "__init__.py", files.keys())
        graph[module] = {name for name in imported if name in files and name != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as the list of its modules (first repeated at the end), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module], _ = "open", path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*path[path.index(target):], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module], _ = "done", path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_import_cycle_among_harness_modules():
    cycle = find_cycle(import_graph(HARNESS))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The layers, top to bottom (README "How a run works"): a module imports its own layer's
# modules or lower layers', never a higher one.
LAYERS = (
    ("harness.__main__", "harness.cli"),  # the commands: cli.py and cli_*.py
    ("harness.runner",),
    ("harness.report",),
    ("harness.suites", "harness.suite_files"),
    ("harness.claims",),
    ("harness.predict",),
    ("harness.training", "harness.calibration"),
    ("harness.results", "harness.measure", "harness.markers", "harness.equivalence", "harness.convergence",
     "harness.suite_cell", "harness.data"),
    ("harness.config",),
    ("harness.strategies",),
    ("harness.features", "harness.models", "harness.distributed", "harness.faults", "harness.entry"),
)


def _layer(module: str) -> int:
    found = {i for i, layer in enumerate(LAYERS) for prefix in layer if module.startswith(prefix)}
    if len(found) != 1:
        raise AssertionError(f"{module} is in layers {sorted(found)} of LAYERS: place it in one")
    return found.pop()


def test_every_module_imports_only_its_own_layer_or_lower_ones():
    graph = import_graph(HARNESS)
    upward = [f"{a} -> {b}" for a, targets in graph.items() if a != "harness"  # the package's own __init__
              for b in targets if _layer(b) < _layer(a)]
    assert upward == []


def test_the_cycle_check_finds_a_planted_cycle_through_a_function_level_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    graph = import_graph(package)
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    assert graph["pkg.d"] == set()  # annotations only: not a runtime import


def test_importing_config_loads_neither_torch_nor_transformers():
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, harness.config; print(sorted({m.split('.')[0] for m in sys.modules}))"],
        capture_output=True, text=True, check=True).stdout
    assert "'torch'" not in loaded and "'transformers'" not in loaded, loaded


def test_every_strategy_file_is_registered():
    files = {p.stem for p in (HARNESS / "strategies").glob("*.py")} - {"__init__", "base"}
    declared_in = {s.prepare.__module__.rsplit(".", 1)[-1] for s in strategies.declarations()}
    assert files == declared_in, "add the new file to harness/strategies/__init__.py's list"


@pytest.mark.parametrize("strategy", strategies.declarations(), ids=lambda s: s.name)
def test_each_declaration_is_complete_and_consistent(strategy: Strategy):
    assert isinstance(strategy, Strategy) and strategy.summary
    assert strategy.name in markers.CATALOGUE
    assert all(family in markers.CATALOGUE for family in strategy.families)
    caps = strategy.capabilities
    for values, axis in ((caps.precisions, config.Precision), (caps.checkpointing, config.Checkpointing),
                         (caps.offload, config.Offload), (caps.optimizers, config.Optimizer),
                         (caps.compression, config.Compression)):
        assert values and values <= set(get_args(axis)), (axis, values)
    assert caps.min_world_size >= 1 and (caps.max_world_size or caps.min_world_size) >= caps.min_world_size
    assert set(strategy.options) <= set(get_args(LayoutOption))
    assert all(isinstance(v, int) and v >= 1 for k, v in strategy.options.items() if k != "hsdp_mesh")
    # A spec of the strategy with every option at its default resolves and round-trips.
    spec = config.StrategySpec(name=strategy.name)
    assert config.StrategySpec(**dataclasses.asdict(spec)) == spec
    if spec.pipelined:
        assert "pp_microbatches" in strategy.options
    model = strategy.engine_model
    assert (model.pipeline_schedule is not None) == (model.analytic == "pipeline")
    assert strategy.superseded_by is None or strategy.superseded_by in strategies.names()
    assert callable(strategy.prepare) and strategy.prepare.__module__.startswith("harness.strategies.")


def test_unknown_strategies_are_refused_naming_the_declared_ones():
    with pytest.raises(ValueError, match="strategy='zero4': choose one of single, ddp, dataparallel, zero1"):
        strategies.get("zero4")
    assert len(set(strategies.names())) == len(strategies.names())
