"""Run a selection of cells: references first, one launch per world size, every outcome
recorded (with its equivalence verdict) the moment it is known, and a progress line per cell.
A resumed run starts from the records it keeps (``recorded``) and runs only the other cells.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import groupby

from harness import equivalence, markers, strategies
from harness.config import CellSpec
from harness.measure import flops, summary
from harness.predict import accuracy, traced
from harness.results.schema import make_record
from harness.results.store import RunStore
from harness.runner.launcher import CellOutcome, LaunchOptions, run_batch


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


class MatrixRun:
    def __init__(self, cells: list[CellSpec], store: RunStore, options: LaunchOptions, *,
                 device_type: str, device_name: str | None, progress: Callable[[str], None],
                 recorded: dict[str, dict] | None = None):
        self.cells = with_references(cells)
        self.store = store
        self.options = options
        self.device_type = device_type
        self.device_name = device_name
        self.progress = progress
        # Kept records of a resumed run count as done; a kept reference gates the cells run now.
        self.records: dict[str, dict] = {c.cell_id: recorded[c.cell_id] for c in self.cells
                                         if recorded and c.cell_id in recorded}
        self.complete = False  # every cell has a record (False after an interrupt)
        self._traced: dict[str, dict] = {}
        self._started = 0.0
        self._resumed_from = len(self.records)

    def run(self) -> dict[str, dict]:
        todo = [c for c in self.cells if c.cell_id not in self.records]
        if self._resumed_from:
            self.progress(f"shardbench: resuming: {self._resumed_from} of {len(self.cells)} cells recorded"
                          f" and kept, {len(todo)} to run")
        unsupported = {c.cell_id: strategies.unsupported_reason(c, self.device_type) for c in todo}
        runnable = [c for c in todo if not unsupported[c.cell_id]]
        if runnable:
            # Before any cell runs: the trace would compete with the ranks for the cores.
            started = time.monotonic()
            self.progress(f"shardbench: tracing {len(runnable)} cells under FakeTensorMode (predicted peak memory)")
            self._traced = traced.trace_cells(runnable)
            self.progress(f"shardbench: traced in {human_duration(time.monotonic() - started)}")
        self._started = time.monotonic()
        for cell in todo:
            if unsupported[cell.cell_id]:
                self._finish(cell, make_record(cell, markers=markers.markers_of(cell), status="unsupported",
                                               reason=unsupported[cell.cell_id],
                                               predicted=accuracy.prediction(cell, None)))
        for world_size, group in groupby(runnable, key=lambda c: c.world_size):
            run_batch(list(group), self.options, self.store.path / "launches" / f"ws{world_size}",
                      self._on_outcome)
        self.complete = True
        return self.records

    def _on_outcome(self, outcome: CellOutcome) -> None:
        cell = outcome.cell
        predicted = accuracy.prediction(cell, self._traced.get(cell.cell_id))
        common = dict(markers=markers.markers_of(cell), wall_s=outcome.wall_s)
        if outcome.status != "ok":
            record = make_record(cell, status=outcome.status, reason=outcome.reason, predicted=predicted, **common)
        else:
            rank0 = outcome.per_rank[0]
            peak = flops.peak_flops(self.device_name, cell.strategy.precision)
            is_reference = cell.reference().cell_id == cell.cell_id
            metrics = summary.summarize(cell, outcome.per_rank, peak)
            record = make_record(
                cell,
                status="ok",
                n_params=rank0["n_params"],
                attn_implementation=rank0["attn_implementation"],
                metrics=metrics,
                predicted={**predicted, "ratios": accuracy.compare(predicted, metrics)},
                per_rank=summary.per_rank_view(outcome.per_rank),
                losses=rank0["losses"],
                equivalence=None if is_reference else equivalence.check(
                    cell, rank0["losses"], self.records.get(cell.reference().cell_id)),
                **common,
            )
        self._finish(cell, record)

    def _finish(self, cell: CellSpec, record: dict) -> None:
        self.records[cell.cell_id] = record
        self.store.append(record)
        self.progress(self._progress_line(record))

    def _progress_line(self, record: dict) -> str:
        done, total = len(self.records), len(self.cells)
        elapsed = time.monotonic() - self._started
        eta = elapsed / (done - self._resumed_from) * (total - done)
        m = record["metrics"]
        status = record["status"]
        eq = record["equivalence"]
        if eq is not None and not eq["passed"]:
            status = "ok, NOT EQUIVALENT" if status == "ok" else status
        detail = (f"peak {human_bytes(m['peak_mem_bytes'])}  step {m['step_time_s'] * 1e3:.1f} ms"
                  if status.startswith("ok") else record["reason"].splitlines()[0][:100] if record["reason"] else "")
        return f"[{done:>3}/{total}] {status:<11} {record['cell_id']:<58} {detail}  (ETA {human_duration(eta)})"

    def record_of(self, cell: CellSpec) -> dict | None:
        return self.records.get(cell.cell_id)
