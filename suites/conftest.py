"""pytest plumbing for the matrices: one test per cell, markers per axis value, and one
session-wide MatrixRun that launches the selected cells (plus their references) in batches.

Tests only read outcomes: the cells run when the first test asks for its result, so the
progress lines appear while the matrix runs and pytest's verdicts follow.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from harness import distributed, markers, suites, suites_gpu
from harness.config import add_run_options
from harness.results.store import ResultsNotWritable
from harness.runner import resume
from harness.runner import session as run_session


def pytest_addoption(parser: pytest.Parser) -> None:
    add_run_options(parser.getgroup("shardbench").addoption, "pytest", suite_names=suites.SUITES)


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in markers.CATALOGUE.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    try:
        options = run_session.run_options(config)
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
    if options.marker_expression:
        try:
            markers.check_marker_expression(options.marker_expression)
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None
    if options.resume is not None:
        # `python -m harness run --resume` checks this before pytest; here for pytest used directly.
        resume_dir = Path(options.resume)
        try:
            resume.check_same_selection(resume_dir, resume.original_selection(resume_dir), {
                "suite": options.suite, "marker_expression": options.marker_expression,
                "keyword_expression": options.keyword_expression,
                "world_size": distributed.job_world_size(options.gpus, nodes.nnodes), "nnodes": nodes.nnodes,
                **({} if options.repeat is None else {"repeat": options.repeat})})
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" not in metafunc.fixturenames:
        return
    options, nnodes = run_session.run_options(metafunc.config), run_session.node_spec(metafunc.config).nnodes
    try:
        cells = suites.cells_of(options.suite, distributed.job_world_size(options.gpus, nnodes), nnodes,
                                suites_gpu.target(options.gpu_mem_bytes))
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
    suite = run_session.run_options(config).suite
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
    # Interpreter shutdown's collections skip what is frozen (harness/entry.py): 1.3 s of a
    # run's exit otherwise.
    gc.freeze()


@pytest.fixture(scope="session")
def matrix(pytestconfig: pytest.Config) -> run_session.MatrixRun:
    """The run of every selected cell, started on first use."""
    try:
        return run_session.start(pytestconfig)
    except ResultsNotWritable as error:
        run_session.stop_unwritable(pytestconfig, error)


def pytest_sessionfinish(session: pytest.Session) -> None:
    run_session.write_report(session)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    run_session.summarize(config, terminalreporter)
