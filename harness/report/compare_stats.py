"""Which cells of two runs changed, and whether the change is significant: the cells paired,
their changes, the rank test, the marks and the ``--fail-on`` thresholds. Run A is the
baseline, run B the candidate; harness/report/compare.py renders the result.

For every cell id present in both runs with status ``ok`` in both, three changes are given,
each with a mark ``better`` / ``worse`` / ``not significant`` (``same`` for exactly equal
memory):

Peak memory (``metrics.peak_mem_bytes``; deterministic on CPU, it counts tensor bytes):
    change = B / A - 1.  ``same`` if B == A; ``worse`` if change > +0.5 %; ``better`` if
    change < -0.5 %; otherwise ``not significant``.

Step time (decided from the per-step samples, never from two medians alone):
    each run's series is the slowest rank per step: for step i, max over ranks r of
    ``per_rank[r].step_times_s[i]`` (steps every rank has).  ratio = median(B) / median(A)
    (these medians are what ``metrics.step_time_s`` records), change = ratio - 1.
    p = two-sided Mann-Whitney U test of the two series, normal approximation with tie
    correction and continuity correction.
    ``worse``  iff p < 0.05 and ratio > 1.10;
    ``better`` iff p < 0.05 and ratio < 0.90;
    otherwise ``not significant``. The 10 % floor is asv's default (``asv compare
    --factor 1.1``): the same code run twice on a shared host drifts by several per cent as
    other work comes and goes, and a rank test alone calls such drift significant (README
    "Comparing runs" has the measured drift). Fewer than 4 samples on either side: ``not
    significant``, note "too few samples", p = None.
    A run with ``--repeat N`` pools its trials: the series is every ok trial's slowest-rank
    series one after another (N × the timed steps), and the medians are the pooled series'.
    Pooled, not N medians per side: N is usually 3, too few for the rank test, while the
    pooled samples carry the trial-to-trial spread. Samples of one trial share its launch
    and machine state, so p is optimistic when whole trials differ; the 10 % floor is what
    keeps such drift from being called a change.

Throughput (``metrics.tokens_per_s``, else ``samples_per_s``): change = B / A - 1.  A step's
    throughput is the global batch over the slowest rank's step time, a decreasing function
    of it, so the rank test on throughput is the same test as on step time: same p, and the
    mark mirrors the step-time mark (time ``worse`` <=> throughput ``worse``).

A cell's status, peak memory and throughput are its trials folded (harness/results/trials.py:
``ok`` only when every trial is, the median peak and throughput).

Cells only in A or only in B, and cells not ``ok`` in one run, are listed with their statuses;
``ok`` in A and ``oom``/``timeout``/``failed``/``unsupported``/``does_not_fit`` in B is a regression (mark
``worse``), the reverse is ``better``.

``--fail-on`` thresholds (``parse_thresholds``): "mem:5%,time:10%,throughput:10%" (any subset).
``regressions`` returns the cells with a metric marked ``worse`` whose change is beyond its
threshold (memory or step time up by more than it, throughput down by more than it), and
every ``ok`` -> not-``ok`` status change whatever the thresholds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness.results import trials
from harness.results.store import load_records

ALPHA = 0.05
MIN_TIME_EFFECT = 0.10  # |median ratio - 1| must exceed this to mark time/throughput
MEM_THRESHOLD = 0.005  # relative peak-memory change that counts
MIN_SAMPLES = 4

BETTER, WORSE, NOT_SIGNIFICANT, SAME = "better", "worse", "not significant", "same"
THRESHOLD_KEYS = ("mem", "time", "throughput")


@dataclass
class MetricChange:
    """One metric of one cell: A's and B's values, change = B / A - 1, and the verdict."""

    metric: str  # "mem", "time", "throughput"
    a: float | None
    b: float | None
    change: float | None
    mark: str
    p_value: float | None = None
    ratio: float | None = None  # median(B) / median(A) for time; B / A otherwise
    n_a: int | None = None
    n_b: int | None = None
    note: str = ""


@dataclass
class CellComparison:
    cell_id: str
    # "compared" (ok in both), "only_a", "only_b", "status_change", "not_ok" (not ok in both)
    kind: str
    status_a: str | None
    status_b: str | None
    mem: MetricChange | None = None
    time: MetricChange | None = None
    throughput: MetricChange | None = None
    reason_a: str = ""
    reason_b: str = ""
    note: str = ""

    @property
    def metrics(self) -> list[MetricChange]:
        return [m for m in (self.mem, self.time, self.throughput) if m is not None]

    @property
    def status_regression(self) -> bool:
        return self.kind == "status_change" and self.status_a == "ok"

    @property
    def verdict(self) -> str:
        """The cell's overall mark: worse if anything got worse, better if anything got
        better and nothing worse, else not significant; "" for cells not compared."""
        if self.kind == "status_change":
            return WORSE if self.status_a == "ok" else BETTER
        if self.kind != "compared":
            return ""
        marks = {m.mark for m in self.metrics}
        if WORSE in marks:
            return WORSE
        if BETTER in marks:
            return BETTER
        return NOT_SIGNIFICANT


@dataclass
class Regression:
    comparison: CellComparison
    reasons: list[str] = field(default_factory=list)

    @property
    def cell_id(self) -> str:
        return self.comparison.cell_id



# ---------------------------------------------------------------- statistics


def _average_ranks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """1-based ranks with ties given their average rank, and the tie-group sizes."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    starts = np.cumsum(counts) - counts  # 0-based position of each group's first element
    avg = starts + (counts + 1) / 2.0
    return avg[inverse], counts


def mann_whitney_u(x, y) -> tuple[float, float]:
    """Two-sided Mann-Whitney U test (normal approximation, tie and continuity corrected).
    Returns (U of x, p). p = 1 when every value is tied."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise ValueError("mann_whitney_u needs at least one sample on each side")
    n = n1 + n2
    ranks, counts = _average_ranks(np.concatenate([x, y]))
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2.0)
    mu = n1 * n2 / 2.0
    tie_term = float((counts.astype(float) ** 3 - counts).sum()) / (n * (n - 1)) if n > 1 else 0.0
    var = n1 * n2 / 12.0 * ((n + 1) - tie_term)
    if var <= 0:
        return u1, 1.0
    z = max(abs(u1 - mu) - 0.5, 0.0) / math.sqrt(var)
    return u1, min(1.0, math.erfc(z / math.sqrt(2.0)))


def pooled_series(trial_records: list[dict]) -> list[float]:
    """A cell's samples in one run: the slowest-rank series of each ok trial, in trial order."""
    return [t for r in trial_records if r["status"] == "ok" for t in slowest_rank_series(r)]


def slowest_rank_series(record: dict) -> list[float]:
    """For each step index, the max over ranks of per_rank[r].step_times_s[i]."""
    lists = [r.get("step_times_s") or [] for r in record.get("per_rank") or []]
    lists = [lst for lst in lists if lst]
    if not lists:
        return []
    steps = min(len(lst) for lst in lists)
    series = []
    for i in range(steps):
        vals = [lst[i] for lst in lists if lst[i] is not None]
        if vals:
            series.append(float(max(vals)))
    return series


# ---------------------------------------------------------------- comparison


def _rel(a, b) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a - 1.0


def compare_memory(a: float | None, b: float | None) -> MetricChange:
    change = _rel(a, b)
    if change is None or a is None or b is None:  # _rel gives None where a or b is None
        return MetricChange("mem", a, b, None, NOT_SIGNIFICANT, note="no peak memory")
    if a == b:
        mark = SAME
    elif change > MEM_THRESHOLD:
        mark = WORSE
    elif change < -MEM_THRESHOLD:
        mark = BETTER
    else:
        mark = NOT_SIGNIFICANT
    return MetricChange("mem", a, b, change, mark, ratio=b / a)


def compare_step_times(series_a: list[float], series_b: list[float],
                       median_a: float | None = None, median_b: float | None = None) -> MetricChange:
    """The step-time rule of the module docstring. The medians fall back to the recorded
    metrics.step_time_s when a run has no per-step samples."""
    n_a, n_b = len(series_a), len(series_b)
    a = float(np.median(series_a)) if n_a else median_a
    b = float(np.median(series_b)) if n_b else median_b
    change = _rel(a, b)
    ratio = None if change is None else change + 1.0
    if n_a < MIN_SAMPLES or n_b < MIN_SAMPLES:
        return MetricChange("time", a, b, change, NOT_SIGNIFICANT, ratio=ratio, n_a=n_a, n_b=n_b,
                            note="too few samples")
    _, p = mann_whitney_u(series_a, series_b)
    mark = NOT_SIGNIFICANT
    if p < ALPHA and ratio is not None:
        if ratio > 1.0 + MIN_TIME_EFFECT:
            mark = WORSE
        elif ratio < 1.0 - MIN_TIME_EFFECT:
            mark = BETTER
    return MetricChange("time", a, b, change, mark, p_value=p, ratio=ratio, n_a=n_a, n_b=n_b)


def _throughput(rec_a: dict, rec_b: dict, time: MetricChange) -> MetricChange | None:
    ma, mb = rec_a.get("metrics") or {}, rec_b.get("metrics") or {}
    for key in ("tokens_per_s", "samples_per_s"):
        if ma.get(key) is not None and mb.get(key) is not None:
            a, b = ma[key], mb[key]
            change = _rel(a, b)
            mark = {WORSE: WORSE, BETTER: BETTER}.get(time.mark, NOT_SIGNIFICANT)
            return MetricChange("throughput", a, b, change, mark, p_value=time.p_value,
                                ratio=None if change is None else change + 1.0,
                                n_a=time.n_a, n_b=time.n_b, note=key if not time.note else f"{key}; {time.note}")
    return None


def compare_records(rec_a: dict, rec_b: dict, series_a: list[float], series_b: list[float]) -> CellComparison:
    """Both records (trials folded) have status ok; ``series_*``: each run's step-time samples
    (``pooled_series``)."""
    ma, mb = rec_a.get("metrics") or {}, rec_b.get("metrics") or {}
    mem = compare_memory(ma.get("peak_mem_bytes"), mb.get("peak_mem_bytes"))
    time = compare_step_times(series_a, series_b, ma.get("step_time_s"), mb.get("step_time_s"))
    return CellComparison(rec_a["cell_id"], "compared", "ok", "ok", mem=mem, time=time,
                          throughput=_throughput(rec_a, rec_b, time))


def compare_record_lists(records_a: list[dict], records_b: list[dict]) -> list[CellComparison]:
    """Every trial of each run's cells in, one CellComparison per cell out."""
    trials_a, trials_b = trials.by_cell(records_a), trials.by_cell(records_b)
    a = {cell_id: trials.combine(t) for cell_id, t in trials_a.items()}
    b = {cell_id: trials.combine(t) for cell_id, t in trials_b.items()}
    out: list[CellComparison] = []
    for cell_id in sorted(set(a) | set(b)):
        ra, rb = a.get(cell_id), b.get(cell_id)
        if rb is None:
            assert ra is not None  # cell_id is in a or in b
            out.append(CellComparison(cell_id, "only_a", ra["status"], None, reason_a=ra.get("reason", ""),
                                      note="only in A"))
        elif ra is None:
            out.append(CellComparison(cell_id, "only_b", None, rb["status"], reason_b=rb.get("reason", ""),
                                      note="only in B"))
        elif ra["status"] == "ok" and rb["status"] == "ok":
            out.append(compare_records(ra, rb, pooled_series(trials_a[cell_id]), pooled_series(trials_b[cell_id])))
        else:
            kind = "not_ok" if ra["status"] == rb["status"] or "ok" not in (ra["status"], rb["status"]) \
                else "status_change"
            note = f"{ra['status']} → {rb['status']}"
            if kind == "status_change":
                note += " (regression)" if ra["status"] == "ok" else " (fixed)"
            out.append(CellComparison(cell_id, kind, ra["status"], rb["status"], reason_a=ra.get("reason", ""),
                                      reason_b=rb.get("reason", ""), note=note))
    return out


def compare_runs(run_a: Path, run_b: Path) -> list[CellComparison]:
    """A = baseline, B = candidate; one CellComparison per cell id in either run, sorted."""
    return compare_record_lists(load_records(Path(run_a)), load_records(Path(run_b)))


# ---------------------------------------------------------------- thresholds

_THRESHOLD_RE = re.compile(r"^\s*([a-z]+)\s*:\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$")


def parse_thresholds(spec: str | dict | None) -> dict[str, float]:
    """"mem:5%,time:10%,throughput:10%" -> {"mem": 0.05, "time": 0.10, "throughput": 0.10}."""
    if spec is None:
        return {}
    if isinstance(spec, dict):
        return dict(spec)
    usage = (f"--fail-on={spec!r}: expected comma-separated KEY:N% with KEY one of"
             f" {', '.join(THRESHOLD_KEYS)} (e.g. mem:5%,time:10%)")
    out: dict[str, float] = {}
    parts = spec.split(",")
    if not spec.strip():
        raise ValueError(usage)
    for part in parts:
        m = _THRESHOLD_RE.match(part)
        if not m or m.group(1) not in THRESHOLD_KEYS or m.group(1) in out:
            raise ValueError(usage)
        out[m.group(1)] = float(m.group(2)) / 100.0
    return out


def regressions(comparisons: list[CellComparison], thresholds: str | dict | None) -> list[Regression]:
    """Cells with a metric marked worse beyond its threshold, and every ok -> not-ok cell."""
    limits = parse_thresholds(thresholds)
    out = []
    for c in comparisons:
        reasons = []
        if c.status_regression:
            reasons.append(f"status {c.status_a} → {c.status_b}")
        for m in c.metrics:
            limit = limits.get(m.metric)
            if limit is None or m.mark != WORSE or m.change is None:
                continue
            amount = -m.change if m.metric == "throughput" else m.change
            if amount > limit:
                reasons.append(f"{m.metric} {m.change:+.1%} (threshold {limit:.0%})")
        if reasons:
            out.append(Regression(c, reasons))
    return out
