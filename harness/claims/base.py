"""What a claim is and what judging one gives: ``Claim`` (the published statement, its
formula, the cells it reads and its judge), ``Readings`` (the run's records as a judge sees
them), ``Outcome`` (a judge's verdict and numbers) and ``NotMeasurable``; the claims cell
(``cell``) and the tolerances the judges compare with.

Conventions: memory in bytes per rank, communication in bytes per rank per step in the
harness's counting convention (harness/measure/comm.py) and, for volumes, ZeRO §7's (an
all-reduce counts twice), from the cells' records (README "Results format").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from harness.config import CellSpec, StrategySpec
from harness.suite_cell import suite_cell

VERDICTS = ("holds", "does not hold", "not measurable here")

MODEL = "gpt2-tiny"

# No timing is read: the fewest steps every claims cell accepts (PowerSGD's 3 warm-up steps,
# the memory and the comm probe, 2 timed); one count for all, as the cells share references.
STEPS = 7

# Tolerances, decided from what the quantities are (README "Claims" gives the reasons):
MODEL_STATES_TOL = 0.10  # the brief's; tensor bytes are exact, engines add alignment padding
COMM_TOL = 0.02  # byte counts are exact; only padding and scalar flags (4-8 B) separate them
ACTIVATIONS_TOL = 0.20  # the formula leaves out small terms (embeddings, final norm, loss)
EXACT_TOL = 0.01  # formula and measurement count the same tensors


def cell(strategy: str, world_size: int, attention: str = "sdpa", **options) -> CellSpec:
    """A claims cell: GPT-2 tiny, fp32 AdamW, SDPA attention unless the options vary it."""
    return suite_cell(MODEL, StrategySpec(name=strategy, **options), world_size, steps=STEPS, attention=attention)


class NotMeasurable(Exception):
    """A claim cannot be measured: ``failed`` when a cell crashed or left no numbers (the
    test fails), not when the host cannot run it (the test is skipped)."""

    def __init__(self, reason: str, *, failed: bool = False):
        super().__init__(reason)
        self.failed = failed


@dataclass(frozen=True, kw_only=True)
class Outcome:
    predicted: float | None
    measured: float | str | None
    verdict: str
    reason: str = ""
    details: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if isinstance(self.measured, (int, float)) and self.predicted:
            return self.measured / self.predicted
        return None


class Readings:
    """The claim's view of a run: its cells' records, refused unless measured. A run with
    --repeat gives each cell's trials folded (harness/results/trials.py: median metrics, the
    per-rank numbers of the trial nearest the median, ok only when every trial was)."""

    def __init__(self, record_of: Callable[[CellSpec], dict | None], world_size: int):
        self._record_of = record_of
        self.world_size = world_size

    def cell(self, strategy: str, attention: str = "sdpa", **options) -> CellSpec:
        return cell(strategy, self.world_size, attention, **options)

    def record(self, c: CellSpec) -> dict:
        record = self._record_of(c)
        if record is None:
            raise NotMeasurable(f"{c.cell_id}: no record (the cell was not run)", failed=True)
        if record["status"] != "ok":
            first = (record.get("reason") or "").strip().splitlines()
            raise NotMeasurable(f"{c.cell_id}: {record['status']}" + (f": {first[0]}" if first else ""),
                                failed=record["status"] not in ("unsupported", "oom", "does_not_fit"))
        return record


@dataclass(frozen=True, kw_only=True)
class Claim:
    claim_id: str
    title: str
    source: str
    published: str
    formula: str
    tolerance: str
    unit: str
    judge: Callable[[Readings], Outcome]
    cells: Callable[[int], list[CellSpec]] = lambda world_size: []
    # Why the claim does not hold here, when that is understood and written down
    # (catalogue.DEVIATIONS): its "does not hold" is then an expected failure.
    deviation: str | None = None


def compare(measured: float, predicted: float, tol: float, *, details: dict | None = None,
            note: str = "") -> Outcome:
    """Holds when measured / predicted is within ±``tol`` of 1; ``note`` joins the reason."""
    ok = abs(measured / predicted - 1) <= tol
    reason = note if ok else (f"measured / predicted = {measured / predicted:.3f}, outside ±{tol:.0%}"
                              + (f"; {note}" if note else ""))
    return Outcome(predicted=predicted, measured=measured, verdict="holds" if ok else "does not hold",
                   reason=reason, details=details or {})


