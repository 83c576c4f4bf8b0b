"""pytest plumbing for the matrices: one test per cell, markers per axis value, and one
session-wide MatrixRun that launches the selected cells (plus their references) in batches.

Tests only read outcomes: the cells run when the first test asks for its result, so the
progress lines appear while the matrix runs and pytest's verdicts follow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import markers, suites
from harness.runner import resume
from harness.runner import session as run_session


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardbench")
    group.addoption("--suite", default="default", help=f"matrix to run: {', '.join(suites.SUITES)}")
    group.addoption("--gpus", type=int, default=None,
                    help="ranks per node: GPUs, or CPU processes where there are none (default: all GPUs, else 2)")
    group.addoption("--out", type=Path, default=None, help="folder for results/ and reports/ (default: the repo root)")
    group.addoption("--nnodes", type=int, default=1, help="nodes in the job (one launcher per node; default 1)")
    group.addoption("--node-rank", type=int, default=0, help="this node's rank in [0, nnodes); only node 0 runs"
                    " under pytest (the others: python -m harness run)")
    group.addoption("--master-addr", default=None, help="node 0's address: the c10d rendezvous endpoint's host")
    group.addoption("--master-port", type=int, default=29500, help="the rendezvous endpoint's port (default 29500)")
    group.addoption("--cell-timeout", type=float, default=None,
                    help="seconds without progress before a cell is declared hung and killed (default: scaled"
                         " to each cell, harness/runner/timeouts.py)")
    group.addoption("--mem-cap-bytes", type=int, default=None,
                    help="memory per rank (python -m harness run --mem-cap-gib): a rank over it records oom")
    group.addoption("--resume", type=Path, default=None,
                    help="run folder to resume: run only its cells without a kept record, appending to it")
    group.addoption("--retry-failed", action="store_true",
                    help="with --resume: also re-run the cells recorded failed, timeout or oom")
    group.addoption("--memory-snapshot", action="store_true", default=False,
                    help="write each cell's memory timeline (and on CUDA the allocator snapshot) to the run folder's memory/")
    # None when not given: a new run runs each cell once, a resumed run as many times as it did.
    group.addoption("--repeat", type=int, default=None,
                    help="run each cell N times, in N interleaved rounds, recording every trial (default 1;"
                         " with --resume: the run's own)")


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in markers.CATALOGUE.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    try:
        nodes = run_session.node_spec(config)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    if not nodes.is_leader:
        # Node 0 writes the run; a second pytest session would write a competing one.
        raise pytest.UsageError(f"--node-rank {nodes.node_rank}: only node 0 runs the suite under pytest;"
                                " start the other nodes with `python -m harness run` (or ./run_all.sh)")
    try:
        run_session.open_plan_server(config)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    expr = config.getoption("markexpr")
    if expr:
        try:
            markers.check_marker_expression(expr)
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None
    repeat = config.getoption("repeat")
    if repeat is not None and repeat < 1:
        raise pytest.UsageError(f"--repeat {repeat}: must be 1 or more (how many times each cell runs)")
    resume_dir = config.getoption("resume")
    if resume_dir is not None:
        # `python -m harness run --resume` checks this before pytest; here for pytest used directly.
        try:
            resume.check_same_selection(resume_dir, resume.original_selection(resume_dir), {
                "suite": config.getoption("suite"), "marker_expression": config.getoption("markexpr") or "",
                "keyword_expression": config.getoption("keyword") or "",
                "world_size": run_session.world_size(config.getoption("gpus"), config.getoption("nnodes")),
                "nnodes": config.getoption("nnodes"),
                **({} if repeat is None else {"repeat": repeat})})
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" not in metafunc.fixturenames:
        return
    config = metafunc.config
    try:
        nnodes = config.getoption("nnodes")
        cells = suites.cells_of(config.getoption("suite"), run_session.world_size(config.getoption("gpus"), nnodes),
                                nnodes)
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
    cells = run_session.selected_cells(session.items)
    session.config.stash[run_session.SELECTED] = cells
    if not cells and run_session.node_spec(session.config).multi:
        # Nothing will start the run: tell the other nodes now rather than let them wait.
        run_session.publish_plan(session.config, run_session.Plan(run_id=None, rounds=[], cell_timeout_s=None,
                                                                  mem_cap_bytes=None))


def pytest_unconfigure(config: pytest.Config) -> None:
    run_session.close_plan_server(config)


@pytest.fixture(scope="session")
def matrix(pytestconfig: pytest.Config) -> run_session.MatrixRun:
    """The run of every selected cell, started on first use."""
    return run_session.start(pytestconfig)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    run_session.summarize(config, terminalreporter)
