"""Run a selection of cells: references first, one launch per world size, every outcome
recorded (with its equivalence verdict) the moment it is known, and a progress line per cell.

With ``repeat`` N the selection runs in N rounds, as asv does: round 1 runs every cell once,
round 2 every cell again in fresh launches, and so on, so machine noise (another job, a
thermal or frequency change) spreads over every cell instead of landing on one cell's trials.
Each record carries its ``trial`` (0-based); a trial is gated against the reference's record
of the same trial (it ran earlier in the same round), else any recorded trial of it. Cells are
traced once, and a cell not launched is recorded once (trial 0): ``unsupported``, or on a GPU
``does_not_fit`` (harness/predict/fit.py; ``launch_anyway`` launches those).

A resumed run starts from the records it keeps (``recorded``, by (cell, trial)) and runs only
the (cell, trial) pairs without one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from itertools import groupby
from pathlib import Path
from typing import Any

from harness import equivalence, markers, strategies
from harness.config import CellSpec
from harness.measure import flops, summary
from harness.predict import accuracy, fit, traced
from harness.results import trials
from harness.results.schema import make_record
from harness.results.store import RunStore
from harness.runner import timeouts
from harness.runner.launcher import CellOutcome, LaunchOptions, nodes_of, run_batch


def with_references(cells: list[CellSpec]) -> list[CellSpec]:
    """The selection plus every reference it is gated against, references first."""
    refs = [c.reference() for c in cells]
    by_id = {c.cell_id: c for c in refs + cells}
    return sorted(by_id.values(), key=lambda c: (c.world_size, c.strategy.name != "single"))


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def human_duration(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"


def launch_dir_name(world_size: int, trial: int) -> str:
    """The folder of one round's launches of one world size, under launches/ (a follower node
    names its own the same: the name is part of the rendezvous id)."""
    return f"ws{world_size}" if trial == 0 else f"ws{world_size}-trial{trial}"


def launch_round(cells: list[CellSpec], trial: int, options: LaunchOptions, launches_dir: Path,
                 on_outcome: Callable[[CellOutcome], None]) -> None:
    """One round's cells, one run_batch per world size in the order given, each in its folder
    under ``launches_dir``: how node 0 launches them, and so how a follower node must."""
    for world_size, group in groupby(cells, key=lambda c: c.world_size):
        run_batch(list(group), options, launches_dir / launch_dir_name(world_size, trial), on_outcome)


class MatrixRun:
    def __init__(self, cells: list[CellSpec], store: RunStore, options: LaunchOptions, *,
                 device_type: str, device_name: str | None, progress: Callable[[str], None],
                 repeat: int = 1, recorded: dict[tuple[str, int], dict] | None = None,
                 on_round_end: Callable[[int], None] | None = None,
                 fit_memory_bytes: int | None = None, launch_anyway: bool = False,
                 calibration: dict | None = None):
        if repeat < 1:
            raise ValueError(f"repeat={repeat}: run each cell at least once")
        self.cells = with_references(cells)
        self.store = store
        self.options = options
        self.device_type = device_type
        self.device_name = device_name
        self.progress = progress
        self.repeat = repeat
        self.on_round_end = on_round_end  # called with the trial number as each round ends
        # run.json's environment.bandwidth: the sweep and compute rates the step times are priced
        # at; over several nodes, with the sweep across them as "across_nodes" (runner/session.py).
        self.calibration = calibration
        self._unsupported = {c.cell_id: strategies.unsupported_reason(c, device_type)
                             or timeouts.too_slow_reason(c, device_type) for c in self.cells}
        # With a GPU's memory per rank: each cell's predicted fit, checked before anything launches.
        self._fit = ({c.cell_id: fit.check(c, fit_memory_bytes, device_type) for c in self.cells}
                     if fit_memory_bytes is not None else {})
        self._not_launched = ({cell_id for cell_id, reason in self._unsupported.items() if reason}
                              | {cell_id for cell_id, f in self._fit.items()
                                 if f is not None and not f.fits and not launch_anyway})
        # Every (cell, trial) to record, round by round; a cell not launched only in round 1.
        self.planned = [(c, trial) for trial in range(repeat) for c in self.cells
                        if trial == 0 or c.cell_id not in self._not_launched]
        # Kept records of a resumed run count as done; a kept reference gates the cells run now.
        self.by_trial: dict[tuple[str, int], dict] = {(c.cell_id, t): recorded[c.cell_id, t] for c, t in self.planned
                                                      if recorded and (c.cell_id, t) in recorded}
        self.complete = False  # every (cell, trial) has a record (False after an interrupt)
        self._traced: dict[str, dict] = {}
        self._started = 0.0
        self._resumed_from = len(self.by_trial)

    @property
    def records(self) -> dict[str, dict]:
        """cell_id -> the cell's record, its trials folded (harness/results/trials.py)."""
        return {r["cell_id"]: r for r in trials.aggregate(list(self.by_trial.values()))}

    def recorded_count(self) -> str:
        """"N of M cells" with a record ("cell trials" with repeat > 1)."""
        return f"{len(self.by_trial)} of {len(self.planned)} {'cells' if self.repeat == 1 else 'cell trials'}"

    def _todo(self) -> list[tuple[CellSpec, int]]:
        return [(c, t) for c, t in self.planned if (c.cell_id, t) not in self.by_trial]

    def launch_rounds(self) -> list[list[CellSpec]]:
        """Per trial, the cells ``run`` will launch, in launch order (what node 0 serves to
        the other nodes: runner/nodes.py)."""
        todo = self._todo()
        return [[c for c, t in todo if t == trial and c.cell_id not in self._not_launched]
                for trial in range(self.repeat)]

    def run(self) -> dict[str, dict]:
        todo = self._todo()
        no_peak = flops.no_peak_warning(self.device_type, self.device_name)
        if no_peak:
            self.progress(no_peak)
        if self._resumed_from:
            self.progress(f"shardbench: resuming: {self.recorded_count()} recorded and kept, {len(todo)} to run")
        runnable = list({c.cell_id: c for c, _ in todo if c.cell_id not in self._not_launched}.values())
        if self.options.run.no_trace:
            self._traced = {c.cell_id: {"unavailable": "not traced: --no-trace"} for c in runnable}
        elif runnable:
            # Before any cell runs: the trace would compete with the ranks for the cores.
            started = time.monotonic()
            self.progress(f"shardbench: tracing {len(runnable)} cells under FakeTensorMode (predicted peak memory)")
            self._traced = traced.trace_cells(runnable, progress=lambda done, total: self.progress(
                f"shardbench: traced {done:,} of {total:,} cells"))
            self.progress(f"shardbench: traced in {human_duration(time.monotonic() - started)}")
        self._started = time.monotonic()
        for trial in range(self.repeat):
            self._run_round([c for c, t in todo if t == trial], trial)
            if self.on_round_end is not None:
                self.on_round_end(trial)
        self.complete = True
        return self.records

    def _run_round(self, cells: list[CellSpec], trial: int) -> None:
        for cell in (c for c in cells if c.cell_id in self._not_launched):
            unsupported, checked = self._unsupported[cell.cell_id], self._fit.get(cell.cell_id)
            status = "unsupported" if unsupported else "does_not_fit"
            reason = unsupported or (checked.reason() if checked is not None else "")
            self._finish(make_record(cell, markers=markers.markers_of(cell), status=status, reason=reason,
                                     predicted=self._prediction(cell, None),
                                     fit=self._fit_of(cell), trial=trial))
        runnable = [c for c in cells if c.cell_id not in self._not_launched]
        launch_round(runnable, trial, self.options, self.store.path / "launches",
                     partial(self._on_outcome, trial=trial))

    def _prediction(self, cell: CellSpec, traced_peak: dict | None) -> dict:
        return accuracy.prediction(cell, traced_peak, self.device_type, self.calibration,
                                   nodes_of(cell.world_size, self.options.nodes))

    def _reference_record(self, cell: CellSpec, trial: int) -> dict | None:
        """The reference's record of the same trial, else of its earliest recorded trial."""
        ref_id = cell.reference().cell_id
        recorded = {t: r for (cell_id, t), r in self.by_trial.items() if cell_id == ref_id}
        return recorded.get(trial) or (recorded[min(recorded)] if recorded else None)

    def _on_outcome(self, outcome: CellOutcome, trial: int) -> None:
        cell = outcome.cell
        predicted = self._prediction(cell, self._traced.get(cell.cell_id))
        common: dict[str, Any] = dict(markers=markers.markers_of(cell), wall_s=outcome.wall_s, trial=trial,
                                      fit=self._fit_of(cell))
        if outcome.status != "ok":
            # An oom keeps the peak it reached (worker.py); nothing else was measured.
            reached = {} if outcome.peak_reached_bytes is None else {"peak_mem_bytes": outcome.peak_reached_bytes}
            record = make_record(cell, status=outcome.status, reason=outcome.reason, predicted=predicted,
                                 metrics=reached, **common)
        else:
            rank0 = outcome.per_rank[0]
            peak = flops.peak_flops(self.device_name, flops.compute_precision(
                cell.strategy.precision, rank0.get("float32_matmul_precision")))
            is_reference = cell.reference().cell_id == cell.cell_id
            metrics = summary.summarize(cell, outcome.per_rank, peak)
            record = make_record(
                cell,
                status="ok",
                n_params=rank0["n_params"],
                attn_implementation=rank0["attn_implementation"],
                metrics=metrics,
                predicted={**predicted, "ratios": accuracy.compare(predicted, metrics, cell)},
                per_rank=summary.per_rank_view(outcome.per_rank),
                losses=rank0["losses"],
                numerics=rank0["numerics"],
                evaluation=rank0["evaluation"],
                batch_norm=rank0["batch_norm"],
                expert_load=rank0["expert_load"],
                equivalence=None if is_reference else equivalence.check(
                    cell, rank0["losses"], self._reference_record(cell, trial)),
                **common,
            )
        self._finish(record)

    def _fit_of(self, cell: CellSpec) -> dict[str, Any] | None:
        checked = self._fit.get(cell.cell_id)
        return None if checked is None else checked.to_dict()

    def _finish(self, record: dict) -> None:
        self.store.append(record)  # first: a record that could not be written is not counted as recorded
        self.by_trial[record["cell_id"], record["trial"]] = record
        self.progress(self._progress_line(record))

    def _progress_line(self, record: dict) -> str:
        done, total = len(self.by_trial), len(self.planned)
        elapsed = time.monotonic() - self._started
        eta = elapsed / (done - self._resumed_from) * (total - done)
        m = record["metrics"]
        status = record["status"]
        eq = record["equivalence"]
        if eq is not None and eq["passed"] is False:
            status = "ok, NOT EQUIVALENT" if status == "ok" else status
        detail = (f"peak {human_bytes(m['peak_mem_bytes'])}  step {m['step_time_s'] * 1e3:.1f} ms"
                  if status.startswith("ok") else record["reason"].splitlines()[0][:100] if record["reason"] else "")
        trial = f" t{record['trial']}" if self.repeat > 1 else ""
        return (f"[{done:>3}/{total}{trial}] {status:<11} {record['cell_id']:<58} {detail}"
                f"  (ETA {human_duration(eta)})")

    def record_of(self, cell: CellSpec) -> dict | None:
        """The cell's record, its trials folded; None before any trial has one."""
        mine = [r for (cell_id, _), r in self.by_trial.items() if cell_id == cell.cell_id]
        return trials.combine(mine) if mine else None
