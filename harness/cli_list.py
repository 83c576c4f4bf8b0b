"""``python -m harness list``: the cells a selection runs, without running them, as pytest's
own collection selects them (so the listing and the run agree)."""

from __future__ import annotations

import argparse
import sys

import pytest

from harness import cli_catalogue, markers, suites, suites_gpu
from harness.cli_common import UsageError, measured_rates, run_options
from harness.cli_selection import SUITES_DIR, check_selection, pytest_args
from harness.config import CellSpec
from harness.predict import fit, rough_time


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
    from harness.distributed import selected_device
    from harness.runner.matrix import with_references

    if args.what not in ("cells", *cli_catalogue.CATALOGUES):
        raise UsageError(f"list {args.what}: choose one of cells, {', '.join(cli_catalogue.CATALOGUES)}")
    if args.what != "cells":
        print(cli_catalogue.render(args.what))
        return 0
    options = check_selection(run_options(args), listing=True)
    if options.suite in suites.BENCHMARK_SUITES:
        print(f"suite {options.suite} benchmarks the harness itself (suites/test_perf.py): run it with"
              f" ./run_all.sh --suite {options.suite}")
        return 0
    gpu = suites_gpu.target(options.gpu_mem_bytes)
    rates = _rates(args.calibration, gpu)  # refused before pytest collects anything
    collector = _Collector()
    code = pytest.main(pytest_args(options) + ["--collect-only", "-p", "no:terminal"], plugins=[collector])
    if code not in (0, 5):  # 5: nothing selected, still a valid listing
        print(f"shardbench: error: collecting {SUITES_DIR} failed (pytest exit {int(code)});"
              f" `pytest {SUITES_DIR} --collect-only` shows why", file=sys.stderr)
        return int(code)
    added = [c for c in with_references(collector.cells) if c not in collector.cells]
    # On a GPU target, each cell's fit, checked once for its line and the summary.
    fits = {} if gpu is None else {c.cell_id: fit.check(c, gpu.memory_bytes) for c in collector.cells + added}
    for cell in collector.cells:
        reason = strategies.unsupported_reason(cell, selected_device())
        note = f"  [unsupported here: {reason}]" if reason else ""
        print(f"{cell.cell_id:<62} {' '.join(markers.markers_of(cell))}{_fit_note(cell, gpu, fits)}{note}")
    for cell in added:
        print(f"{cell.cell_id:<62} (reference, added to gate the selection){_fit_note(cell, gpu, fits)}")
    print(f"{len(collector.cells)} cells selected, {len(added)} references added")
    if gpu is not None:
        print(_gpu_summary(collector.cells + added, gpu, fits, rates))
    return 0


def _rates(calibration: str | None, gpu: suites_gpu.GpuTarget | None) -> rough_time.Rates | None:
    """--calibration's rates for a GPU target's rough time (None: the datasheet assumptions);
    UsageError where there is no GPU target to time or the run measured no GPU."""
    if calibration is None:
        return None
    if gpu is None:
        raise UsageError("--calibration prices a GPU target's rough wall time: give it with --device cuda --gpus N"
                         " --gpu-mem M")
    rates, _ = measured_rates(calibration)
    if rates.device_type != "cuda":
        raise UsageError(f"--calibration {calibration}: it measured a {rates.device_type} host, not a GPU; a GPU"
                         " target's rough time needs a CUDA run's rates")
    return rates


def _fit_note(cell: CellSpec, gpu: suites_gpu.GpuTarget | None, fits: dict[str, fit.Fit | None]) -> str:
    """On a GPU target: the cell's predicted peak per rank, and whether it is launched."""
    if gpu is None:
        return ""
    checked = fits[cell.cell_id]
    if checked is None:
        return "  [no analytic prediction: launched]"
    verdict = "fits" if checked.fits else "does_not_fit: not launched"
    return f"  [predicted {checked.predicted_peak_bytes / 2**30:.1f} GiB per rank: {verdict}]"


def _gpu_summary(cells: list[CellSpec], gpu: suites_gpu.GpuTarget, fits: dict[str, fit.Fit | None],
                 rates: rough_time.Rates | None) -> str:
    """The cells launched on the target and their rough wall time, at ``rates`` (a run's
    calibration) or else the datasheet assumptions for the target's GPU."""
    launched = [c for c in cells if (f := fits[c.cell_id]) is None or f.fits]
    timed = [rough_time.cell_seconds(c, rates or rough_time.assumed(gpu.name, c.world_size)) for c in launched]
    seconds = sum(t for t in timed if t is not None)
    unpriced = sum(t is None for t in timed)
    on = (rates or rough_time.assumed(gpu.name)).source
    return (f"{len(launched)} of {len(cells)} cells predicted to fit {gpu.memory_bytes / 2**30:.1f} GiB per GPU"
            f" ({fit.USABLE_FRACTION:.0%} usable); rough wall time {seconds / 60:.0f} min on {on}"
            + (f" ({unpriced} cells without a step-time prediction not included)" if unpriced else "")
            + f" (harness/predict/rough_time.py, {rough_time.CELL_START_S:.0f} s per cell to start)")
