"""The cell record: the unit of results/<run_id>/cells.jsonl. See README "Results format".

SCHEMA_VERSION changes whenever a field is renamed, removed or changes meaning; readers
migrate older records step by step (``migrate``) so a report can span old and new runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from harness import strategies
from harness.config import CellSpec
from harness.results import provenance

SCHEMA_VERSION = 5
# does_not_fit: predicted not to fit the GPU, so not launched (harness/predict/fit.py).
STATUSES = ("ok", "oom", "timeout", "failed", "unsupported", "does_not_fit")

# A cell record as json.loads gives it back: its fields are described in README "Results format".
Record = dict[str, Any]


def _finite_or_none(values: list[float]) -> list[float | None]:
    """JSON has no NaN or Infinity: a diverged loss (fp16 overflow) is written as null."""
    return [v if math.isfinite(v) else None for v in values]


def make_record(
    cell: CellSpec,
    *,
    markers: list[str],
    status: str,
    reason: str = "",
    n_params: int | None = None,
    attn_implementation: str | None = None,
    metrics: dict[str, Any] | None = None,
    per_rank: list[dict[str, Any]] | None = None,
    losses: list[float] | None = None,
    numerics: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
    batch_norm: dict[str, Any] | None = None,
    expert_load: dict[str, Any] | None = None,
    equivalence: dict[str, Any] | None = None,
    predicted: dict[str, Any] | None = None,
    fit: dict[str, Any] | None = None,
    wall_s: float | None = None,
    trial: int = 0,
) -> Record:
    if status not in STATUSES:
        raise ValueError(f"status={status!r}: choose one of {', '.join(STATUSES)}")
    return {
        "schema_version": SCHEMA_VERSION,
        "cell_id": cell.cell_id,
        "trial": trial,
        "status": status,
        "reason": reason,
        "markers": markers,
        "world_size": cell.world_size,
        "zero_idea": strategies.get(cell.strategy.name).zero_idea,
        "model": {"name": cell.model_name, "n_params": n_params, "attn_implementation": attn_implementation},
        "strategy": dict(cell.to_dict()["strategy"]),
        "precision": cell.strategy.precision,
        "cell": cell.to_dict(),
        "provenance": provenance.of(cell),
        "metrics": metrics or {},
        "per_rank": per_rank or [],
        "losses": _finite_or_none(losses or []),
        # measure/numerics.py; None where the cell did not train (and in records before it).
        "numerics": numerics,
        # Real-data cells' held-out loss over training (harness/data.py); None otherwise.
        "evaluation": evaluation,
        # A model with BatchNorm: what it normalised over and its running statistics at the
        # end (measure/batch_norm.py); None otherwise.
        "batch_norm": batch_norm,
        # A mixture of experts: tokens per expert per step and layer, and each step's
        # imbalance (measure/expert_load.py); None for other models (and in records before it).
        "expert_load": expert_load,
        "equivalence": equivalence,
        "predicted": predicted,
        "fit": fit,
        "wall_s": wall_s,
    }


class UnreadableRecord(ValueError):
    """A record this shardbench cannot bring up to SCHEMA_VERSION (newer, unknown, or a gap
    in the migration chain)."""


# MIGRATIONS[v] turns a version-v record into a version-(v + 1) record; ``migrate`` applies
# them in order. A change of SCHEMA_VERSION from N to N + 1 registers MIGRATIONS[N] in the
# same commit (``@migration(N)``), so every released version stays readable.
MIGRATIONS: dict[int, Callable[[Record], Record]] = {}


def migration(from_version: int) -> Callable[[Callable[[Record], Record]], Callable[[Record], Record]]:
    def register(step: Callable[[Record], Record]) -> Callable[[Record], Record]:
        if from_version in MIGRATIONS:
            raise ValueError(f"a migration from schema_version={from_version} is already registered")
        MIGRATIONS[from_version] = step
        return step

    return register


def migrate(record: Record) -> Record:
    """Bring a record of any released schema version up to SCHEMA_VERSION, one version at a
    time; the record given is not modified."""
    version = record.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version > SCHEMA_VERSION:
        raise UnreadableRecord(
            f"cell record schema_version={version!r} is newer or unknown: this shardbench reads"
            f" up to {SCHEMA_VERSION}; upgrade shardbench"
        )
    while version < SCHEMA_VERSION:
        step = MIGRATIONS.get(version)
        if step is None:
            raise UnreadableRecord(f"cell record schema_version={version}: no migration to"
                                   f" {version + 1} is registered (this shardbench reads {SCHEMA_VERSION})")
        record = step(dict(record))
        version += 1
        record["schema_version"] = version
    return record


@migration(1)
def _trials(record: Record) -> Record:
    """2 added ``trial`` (``--repeat N`` records each run of a cell): a run before it ran each
    cell once."""
    return {**record, "trial": 0}


@migration(2)
def _models_as_data(record: Record) -> Record:
    """3 made the sequence length a cell option (``cell.seq_len``, None: the model's own) and
    let ``cell.model`` be a resolved transformers config (an object) as well as a preset's
    name: a record before it trained a preset at its own length."""
    return {**record, "cell": {**record["cell"], "seq_len": None}}


@migration(3)
def _fit(record: Record) -> Record:
    """4 added ``fit`` (on GPUs, the predicted peak against the memory a rank may use, checked
    before launch; the status ``does_not_fit`` for a cell over it) and ``equivalence.passed``
    None for a cell whose reference does not fit: a record before it was never checked."""
    return {**record, "fit": None}


@migration(4)
def _pipeline_ranks_own_parts(record: Record) -> Record:
    """5 took a pipeline's ``metrics.at_optimizer_step_bytes`` from its rank with the peak,
    whose stages it holds (it had been the least any rank held), and its ``comm_*`` from its
    busiest rank's comm step (they had been rank 0's), and added ``metrics.comm_counted_rank``,
    the rank whose comm step ``comm_*`` counted: a record before it takes its peak rank's
    states from ``per_rank`` and keeps rank 0's communication, as counted. A pipelined cell
    is one whose options resolved ``pp_microbatches`` (config.StrategySpec sets it then only)."""
    metrics = record.get("metrics") or {}
    if "comm_by_op" not in metrics:  # a cell that did not run, or ran out of memory
        return record
    migrated = {**metrics, "comm_counted_rank": 0}
    per_rank = record.get("per_rank") or []
    if record["cell"]["strategy"].get("pp_microbatches") is not None and per_rank:
        migrated["at_optimizer_step_bytes"] = max(per_rank, key=lambda r: r["peak_mem_bytes"]).get(
            "at_optimizer_step_bytes")
    return {**record, "metrics": migrated}
