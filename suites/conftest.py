"""pytest plumbing for the matrices: one test per cell, markers per axis value, and one
session-wide MatrixRun that launches the selected cells (plus their references) in batches.

Tests only read outcomes: the cells run when the first test asks for its result, so the
progress lines appear while the matrix runs and pytest's verdicts follow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import markers, suites
from harness.runner import session as run_session
from harness.runner.launcher import DEFAULT_CELL_TIMEOUT_S


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardbench")
    group.addoption("--suite", default="default", help=f"matrix to run: {', '.join(suites.SUITES)}")
    group.addoption("--gpus", type=int, default=None,
                    help="ranks per node: GPUs, or CPU processes where there are none (default: all GPUs, else 2)")
    group.addoption("--out", type=Path, default=None, help="folder for results/ and reports/ (default: the repo root)")
    group.addoption("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT_S,
                    help="seconds without progress before a cell is declared hung and killed")


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in markers.CATALOGUE.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    expr = config.getoption("markexpr")
    if expr:
        try:
            markers.check_marker_expression(expr)
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" not in metafunc.fixturenames:
        return
    config = metafunc.config
    try:
        cells = suites.cells_of(config.getoption("suite"), run_session.world_size(config.getoption("gpus")))
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    metafunc.parametrize(
        "cell",
        [pytest.param(c, id=c.cell_id, marks=[getattr(pytest.mark, m) for m in markers.markers_of(c)]) for c in cells],
    )


def _kind(item: pytest.Item) -> str:
    if item.path.name == "test_perf.py":
        return "benchmark"
    return "claims" if item.path.parent.name == "claims" else "matrix"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A matrix suite runs test_matrix.py; a benchmark suite (perf) runs test_perf.py; a
    claims suite the claims in claims/ (which run the cells they read)."""
    suite = config.getoption("suite")
    wanted = ("benchmark" if suite in suites.BENCHMARK_SUITES
              else "claims" if suite in suites.CLAIMS_SUITES else "matrix")
    keep = [item for item in items if _kind(item) == wanted]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[run_session.SELECTED] = run_session.selected_cells(session.items)


@pytest.fixture(scope="session")
def matrix(pytestconfig: pytest.Config) -> run_session.MatrixRun:
    """The run of every selected cell, started on first use."""
    return run_session.start(pytestconfig)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    run_session.summarize(config, terminalreporter)
