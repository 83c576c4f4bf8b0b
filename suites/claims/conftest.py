"""pytest plumbing for the claims suite (``--suite claims``): the ``claims`` marker, the cells
the selected claims read (the session's MatrixRun runs them, with their references, before the
first claim is judged), one claim record per test in results/<run_id>/claims.jsonl, and the
claims table at the end of the run.

A claim's verdict decides its test: "holds" passes; "does not hold" fails with the numbers,
or is an expected failure when harness.claims.catalogue.DEVIATIONS explains it (and fails once such a
claim holds again, so the explanation cannot go stale); "not measurable here" is a skip when
this host cannot run a cell and a failure when a cell crashed.
"""

from __future__ import annotations

import pytest

from harness import distributed, markers, suites
from harness.claims import catalogue, records
from harness.runner import session as run_session

_JUDGED = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in markers.TEST_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    config.stash[_JUDGED] = []


def _claim_ids(items: list[pytest.Item]) -> list[str]:
    return [item.callspec.params["claim_id"] for item in items
            if hasattr(item, "callspec") and "claim_id" in item.callspec.params]


@pytest.hookimpl(trylast=True)  # after suites/conftest.py, which selects cells from cell tests
def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    options = run_session.run_options(config)
    if options.suite in suites.CLAIMS_SUITES:
        world_size = distributed.job_world_size(options.gpus)
        config.stash[run_session.SELECTED] = catalogue.cells(world_size, _claim_ids(session.items))


def _message(record: dict) -> str:
    unit = record["unit"]
    ratio = "-" if record["ratio"] is None else f"{record['ratio']:.4f}"
    return (f"{record['claim_id']} ({record['source']}): measured {records.format_value(record['measured'], unit)},"
            f" predicted {records.format_value(record['predicted'], unit)}, ratio {ratio},"
            f" tolerance {record['tolerance']}: {record['verdict']}"
            + (f"; {record['reason']}" if record["reason"] else ""))


@pytest.fixture
def judge(matrix, pytestconfig: pytest.Config):
    """judge(claim_id): evaluate the claim on this run, store its record, decide the test."""
    world_size = distributed.job_world_size(run_session.run_options(pytestconfig).gpus)

    def run(claim_id: str) -> dict:
        record = records.evaluate(claim_id, matrix.record_of, world_size)
        records.append_record(matrix.store.path, record)
        pytestconfig.stash[_JUDGED].append(record)
        verdict, message = record["verdict"], _message(record)
        if verdict == "holds" and catalogue.CLAIMS[claim_id].deviation:
            pytest.fail(f"{message}\nthis claim now holds: remove its explanation from"
                        " harness.claims.catalogue.DEVIATIONS")
        if verdict == "does not hold":
            (pytest.xfail if record["explained"] else pytest.fail)(message)
        if verdict == "not measurable here":
            (pytest.fail if record["cell_failed"] else pytest.skip)(message)
        return record

    return run


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    judged = config.stash.get(_JUDGED, [])
    if not judged:
        return
    terminalreporter.section("shardbench claims")
    terminalreporter.write_line(f"{'claim':<32} {'predicted':>14} {'measured':>14} {'ratio':>7}  verdict")
    for r in judged:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        verdict = r["verdict"] + (" (explained)" if r["explained"] else "")
        terminalreporter.write_line(f"{r['claim_id']:<32} {records.format_value(r['predicted'], r['unit']):>14}"
                                    f" {records.format_value(r['measured'], r['unit']):>14} {ratio:>7}  {verdict}")
