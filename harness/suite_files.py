"""A suite of one's own: cells read from a TOML file (``./run_all.sh --suite my.toml``).

Each ``[[cells]]`` table names cell options; a list is an axis, and the table stands for the
product of its axes. ``[defaults]`` applies to every table (a table's own value wins)::

    [defaults]
    model = "gpt2-tiny"

    [[cells]]
    strategy = ["fsdp_full", "deepspeed_zero3"]
    precision = ["fp32", "bf16"]

    [[cells]]
    strategy = "ddp"
    compression = "powersgd"
    powersgd_rank = [1, 4]

Options are the cell's (harness/config.py): ``model`` (a preset's name, a transformers
``config.json`` path, read from beside the suite file where it is there, or a table
``{ config = "path/config.json", num_hidden_layers = 4 }`` overriding the config's own keys:
harness/models/sources.py), ``seq_len``, ``strategy`` and its feature options,
``micro_batch``, ``steps``, ``warmup``, ``seed``, ``lr`` and ``world_size`` (default: the
run's ranks, ``--gpus`` × nodes). As in the built-in suites, ``strategy = "single"`` is the
one-process reference and takes the whole global batch.

Every problem is a ``ValueError`` naming the file, the table and what is allowed: a file that
cannot be read or is not TOML, an unknown option, a bad value, a combination the strategy
cannot run (a product containing one is refused, not trimmed: split the table).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import strategies
from harness.config import CellSpec, StrategySpec
from harness.models import sources
from harness.suite_cell import suite_cell

SUFFIX = ".toml"
_CELL_OPTIONS = tuple(f.name for f in dataclasses.fields(CellSpec) if f.init and f.name != "strategy")
_STRATEGY_OPTIONS = tuple(f.name for f in dataclasses.fields(StrategySpec) if f.name != "name")
OPTIONS = ("strategy", *_CELL_OPTIONS, *_STRATEGY_OPTIONS)
_TOP_LEVEL = ("description", "defaults", "cells")


def is_suite_file(suite: str) -> bool:
    return suite.endswith(SUFFIX)


def read(path: Path) -> dict:
    """The parsed file, or a ValueError saying why it cannot be read."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--suite {path}: cannot read it ({error})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"--suite {path}: not valid TOML: {error}") from None
    unknown = sorted(set(data) - set(_TOP_LEVEL))
    if unknown:
        raise ValueError(f"--suite {path}: unknown top-level key(s) {', '.join(unknown)}: allowed are"
                         f" {', '.join(_TOP_LEVEL)}")
    if not isinstance(data.get("defaults", {}), dict):
        raise ValueError(f"--suite {path}: [defaults] must be a table of cell options")
    tables = data.get("cells")
    if not tables or not isinstance(tables, list):
        raise ValueError(f"--suite {path}: no [[cells]] tables: a suite file lists its cells as [[cells]] tables")
    return data


def _expand(table: dict) -> list[dict]:
    """The product of a table's list-valued options, one dict per cell."""
    axes = [(key, value if isinstance(value, list) else [value]) for key, value in table.items()]
    return [dict(zip([k for k, _ in axes], combo)) for combo in itertools.product(*(v for _, v in axes))]


def _cell(options: dict, world_size: int, folder: Path) -> CellSpec:
    strategy = StrategySpec(name=options["strategy"], **{k: options[k] for k in _STRATEGY_OPTIONS if k in options})
    cell_options = {k: options[k] for k in _CELL_OPTIONS if k in options}
    cell_options.setdefault("world_size", world_size)
    model = sources.resolve(_beside(cell_options.pop("model"), folder))
    return suite_cell(model, strategy, cell_options.pop("world_size"), **cell_options)


def _beside(model: Any, folder: Path) -> Any:
    """A config path relative to the suite file is read from beside it (where a suite and its
    configs travel together); other paths as given."""
    if isinstance(model, dict) and isinstance(model.get(sources.CONFIG_KEY), str):
        return {**model, sources.CONFIG_KEY: _beside(model[sources.CONFIG_KEY], folder)}
    if isinstance(model, str) and model.endswith(".json") and not Path(model).is_absolute():
        beside = folder / model
        return str(beside) if beside.is_file() else model
    return model


def size(path: Path) -> int:
    """How many cells the file lists: the sum over its tables of the product of their axes,
    counted without building one (a typo can make that product millions)."""
    data = read(path)
    defaults = data.get("defaults", {})
    return sum(math.prod(len(value) if isinstance(value, list) else 1 for value in {**defaults, **table}.values())
               for table in data["cells"] if isinstance(table, dict))


def cells(path: Path, world_size: int, nnodes: int = 1,
          progress: Callable[[int], None] | None = None) -> list[CellSpec]:
    """The file's cells for a run of ``world_size`` ranks over ``nnodes`` nodes;
    ``progress(built)`` after each cell."""
    data = read(path)
    defaults = data.get("defaults", {})
    out: list[CellSpec] = []
    for i, table in enumerate(data["cells"]):
        where = f"--suite {path}, cells[{i}]"
        if not isinstance(table, dict):
            raise ValueError(f"{where}: each [[cells]] entry must be a table of options")
        merged = {**defaults, **table}
        unknown = sorted(set(merged) - set(OPTIONS))
        if unknown:
            raise ValueError(f"{where}: unknown option(s) {', '.join(unknown)}: choose from {', '.join(OPTIONS)}")
        for missing in ("model", "strategy"):
            if missing not in merged:
                raise ValueError(f"{where}: no {missing} given (in the table or in [defaults])")
        empty = [key for key, value in merged.items() if value == []]
        if empty:
            raise ValueError(f"{where}: {', '.join(empty)} = []: an empty axis gives no cells; give a value or drop it")
        for options in _expand(merged):
            try:
                cell = _cell(options, world_size, path.parent)
            except (TypeError, ValueError) as error:
                raise ValueError(f"{where}: {error}") from None
            problem = strategies.incompatibility(cell)
            if problem:
                raise ValueError(f"{where}: {cell.cell_id} is not a valid combination: {problem}")
            if cell.world_size > 1 and cell.world_size % nnodes:
                raise ValueError(f"{where}: {cell.cell_id}: world_size {cell.world_size} does not split over"
                                 f" {nnodes} nodes (every node runs world_size / nnodes ranks): use a multiple"
                                 f" of {nnodes}")
            out.append(cell)
            if progress is not None:
                progress(len(out))
    return out
