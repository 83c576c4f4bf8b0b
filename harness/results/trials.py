"""One record per cell from its trials: ``--repeat N`` records every run of a cell (the
record's ``trial``, 0-based), and every reader that shows a cell (the run report, the history
index, compare, accuracy, reproduce, the session's summary and the claims) folds them here.

The folded record is the record of one trial, the *shown* trial, with these changes:

- ``status``: ``ok`` only when every trial is ``ok``. Otherwise the cell takes the status of
  its first trial that was not ok (that trial is the shown one), its reason prefixed
  "K of N trials ok; trial T: ", and that trial's metrics only (an oom's peak reached, else
  none): a cell that timed out once in three runs is a flaky cell, and showing it ok would
  hide that. The ok trials' numbers stay in ``trials``
  and in their own records.
- ``metrics``: every number in it (step_time_s, step_time_iqr_s, samples_per_s, tokens_per_s,
  tflops_per_rank, mfu, peak_mem_bytes, rss_peak_bytes, comm bytes and time per step) is the
  median over the trials (comm_counted_rank, a rank's number, is the shown trial's, the
  same in every trial). Nested entries (mem_breakdown_bytes, comm_by_op,
  at_optimizer_step_bytes), mfu_suspect and the rest of the record (per_rank, losses,
  predicted) are the shown trial's: the trial whose step time is nearest the median, the
  earliest on a tie. With an odd number of trials that is the median trial itself, so its
  nested entries agree with the medians.
- ``equivalence``: the worst trial's verdict (the first that failed, else the largest loss
  difference): a cell is equivalent only if every trial trained the reference's model.
- ``wall_s``: the trials' sum, the time the cell took in the run.
- ``trials``: {``n``; per trial, in trial order: ``trial``, ``status``, ``step_time_s``,
  ``peak_mem_bytes``, ``wall_s`` (null where a trial measured nothing); ``spread``: (max - min)
  / median of the ok trials' step times; ``peak_mem_range_bytes``: max - min of their peak
  memory, 0 when identical (both null when no trial is ok)}.

A cell with one trial (every run without ``--repeat``, and every ``unsupported`` cell, which
is recorded once) passes through unchanged but for ``trials`` (n = 1, spread 0).
"""

from __future__ import annotations

import statistics
from typing import Any, TypeGuard

from harness.results.schema import Record


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metric(record: Record, key: str) -> float | None:
    value = (record.get("metrics") or {}).get(key)
    return value if _number(value) else None


def by_cell(records: list[Record]) -> dict[str, list[Record]]:
    """Each cell's trial records in trial order, cells in order of their first record. Of two
    records of one (cell, trial) the later one stands, as in the loader."""
    cells: dict[str, dict[int, Record]] = {}
    for record in records:
        cells.setdefault(record["cell_id"], {})[record["trial"]] = record
    return {cell_id: [trials[t] for t in sorted(trials)] for cell_id, trials in cells.items()}


def _summary(trials: list[Record], ok: list[Record]) -> dict[str, Any]:
    times = [t for t in (_metric(r, "step_time_s") for r in ok) if t is not None]
    peaks = [p for p in (_metric(r, "peak_mem_bytes") for r in ok) if p is not None]
    median_time = statistics.median(times) if times else None
    return {
        "n": len(trials),
        "trial": [r["trial"] for r in trials],
        "status": [r["status"] for r in trials],
        "step_time_s": [_metric(r, "step_time_s") for r in trials],
        "peak_mem_bytes": [_metric(r, "peak_mem_bytes") for r in trials],
        "wall_s": [r.get("wall_s") for r in trials],
        "spread": (max(times) - min(times)) / median_time if median_time else None,
        "peak_mem_range_bytes": max(peaks) - min(peaks) if peaks else None,
    }


def _shown(ok: list[Record]) -> Record:
    """The ok trial whose step time is nearest the median (the earliest on a tie)."""
    timed = [(r, t) for r in ok if (t := _metric(r, "step_time_s")) is not None]
    if not timed:
        return ok[0]
    median = statistics.median(t for _, t in timed)
    return min(timed, key=lambda rt: abs(rt[1] - median))[0]


# Numbers that name something, not measure it: the shown trial's.
_IDENTIFIERS = ("comm_counted_rank",)


def _median_metrics(ok: list[Record], shown: Record) -> dict[str, Any]:
    metrics = dict(shown.get("metrics") or {})
    for key in (k for k in metrics if k not in _IDENTIFIERS):
        values = [v for v in (_metric(r, key) for r in ok) if v is not None]
        if len(values) == len(ok):
            metrics[key] = statistics.median(values)
    return metrics


def _worst_equivalence(ok: list[Record], shown: Record) -> dict[str, Any] | None:
    verdicts: list[dict[str, Any]] = [r["equivalence"] for r in ok if r.get("equivalence") is not None]
    if not verdicts:
        equivalence: dict[str, Any] | None = shown.get("equivalence")
        return equivalence
    failed = [v for v in verdicts if v.get("passed") is False]
    return failed[0] if failed else max(verdicts, key=lambda v: v.get("max_rel_loss_diff") or 0.0)


def combine(trials: list[Record]) -> Record:
    """One cell's record from its trial records (by_cell's lists), as the module says."""
    ok = [r for r in trials if r["status"] == "ok"]
    walls = [r["wall_s"] for r in trials if _number(r.get("wall_s"))]
    common = {"wall_s": sum(walls) if walls else None, "trials": _summary(trials, ok)}
    if len(ok) < len(trials):
        shown = next(r for r in trials if r["status"] != "ok")
        reason = shown.get("reason") or ""
        if len(trials) > 1:
            reason = f"{len(ok)} of {len(trials)} trials ok; trial {shown['trial']}: {reason}"
        return {**shown, **common, "reason": reason}
    shown = _shown(ok)
    return {**shown, **common, "metrics": _median_metrics(ok, shown),
            "equivalence": _worst_equivalence(ok, shown)}


def aggregate(records: list[Record]) -> list[Record]:
    """One record per cell (``combine``), in order of each cell's first record."""
    return [combine(trials) for trials in by_cell(records).values()]
