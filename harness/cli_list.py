"""``python -m harness list``: the cells a selection runs, without running them, as pytest's
own collection selects them (so the listing and the run agree)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import pytest

from harness import markers, suites
from harness.cli_common import run_options
from harness.cli_selection import SUITES_DIR, check_selection, pytest_args

if TYPE_CHECKING:
    from harness.config import CellSpec


class _Collector:
    """The cells the session would run, as the suites' conftest files selected them (matrix
    tests by their ``cell``, claims by the cells the selected claims read)."""

    def __init__(self) -> None:
        self.cells: list[CellSpec] = []

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_finish(self, session):
        from harness.runner.session import SELECTED

        yield
        self.cells = session.config.stash.get(SELECTED, [])


def cmd_list(args: argparse.Namespace, extra: list[str]) -> int:
    """The cells pytest would select (its own collection, so selection is identical)."""
    from harness import strategies
    from harness.runner.matrix import with_references

    options = check_selection(run_options(args))
    if options.suite in suites.BENCHMARK_SUITES:
        print(f"suite {options.suite} benchmarks the harness itself (suites/test_perf.py): run it with"
              f" ./run_all.sh --suite {options.suite}")
        return 0
    collector = _Collector()
    code = pytest.main(pytest_args(options) + ["--collect-only", "-p", "no:terminal"], plugins=[collector])
    if code not in (0, 5):  # 5: nothing selected, still a valid listing
        print(f"shardbench: error: collecting {SUITES_DIR} failed (pytest exit {int(code)});"
              f" `pytest {SUITES_DIR} --collect-only` shows why", file=sys.stderr)
        return int(code)
    from harness.distributed import device_type

    added = [c for c in with_references(collector.cells) if c not in collector.cells]
    for cell in collector.cells:
        reason = strategies.unsupported_reason(cell, device_type())
        note = f"  [unsupported here: {reason}]" if reason else ""
        print(f"{cell.cell_id:<62} {' '.join(markers.markers_of(cell))}{note}")
    for cell in added:
        print(f"{cell.cell_id:<62} (reference, added to gate the selection)")
    print(f"{len(collector.cells)} cells selected, {len(added)} references added")
    return 0
