"""``python -m harness savings RUN``: each sharding's measured memory against DDP's, beside
the ZeRO paper's formula for the same model (Rajbhandari et al. 2020, §5; fp32 AdamW: 4 + 4 +
8 bytes per parameter, ``formulas.FP32_ADAM``), as a markdown table.

A row is an ``ok`` cell whose strategy implements a ZeRO stage (its record's ``zero_idea``),
set against the DDP cell of the same run that differs from it in the strategy alone (same
model, sizes, precision, checkpointing, offload, accumulation, optimizer). Two savings are
shown, because they answer different questions:

- at the peak: DDP's peak per rank minus the cell's (what decides whether a job fits);
- of the model states at the optimizer step: parameters + gradients + optimizer state held
  then (``metrics.at_optimizer_step_bytes``), DDP's minus the cell's: what the formula
  describes, since the formula has no activations and no transient buffers.

The formula's saving is ``zero_model_states`` at stage 0 minus at the cell's stage, for the
record's parameter count and world size. fp32 AdamW cells only: under bf16 each engine keeps
its own set of copies (ZeRO's mixed-precision K = 12 describes DeepSpeed's, not FSDP2's), and
an 8-bit or factored optimizer is not Adam's 8 bytes per parameter.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from harness.predict.formulas import FP32_ADAM, zero_model_states

_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
_STATES = ("params", "grads", "optimizer")
_CATEGORIES = ("params", "grads", "optimizer", "activations", "other")


def _key(record: dict[str, Any]) -> str:
    """The cell but for its strategy's name (and the warm-up, which follows the strategy)."""
    cell = {k: v for k, v in record["cell"].items() if k != "warmup"}
    cell["strategy"] = {k: v for k, v in cell["strategy"].items() if k != "name"}
    return json.dumps(cell, sort_keys=True)


def _states(record: dict[str, Any]) -> float:
    held = record["metrics"].get("at_optimizer_step_bytes") or {}
    return float(sum(held.get(k, 0) for k in _STATES))


def rows(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per ZeRO-stage cell with a DDP baseline, in the run's order."""
    ok = [r for r in records
          if r["status"] == "ok" and r["precision"] == "fp32" and r["strategy"]["optimizer"] == "adamw"]
    ddp = {_key(r): r for r in ok if r["strategy"]["name"] == "ddp"}
    out = []
    for record in ok:
        stage = _STAGES.get(record.get("zero_idea") or "")
        base = ddp.get(_key(record))
        if stage is None or base is None:
            continue
        n_params, world_size = record["model"]["n_params"], record["world_size"]
        formula = (zero_model_states(n_params, world_size, 0, **FP32_ADAM).total
                   - zero_model_states(n_params, world_size, stage, **FP32_ADAM).total)
        out.append({"record": record, "baseline": base, "stage": stage,
                    "peak_saving": base["metrics"]["peak_mem_bytes"] - record["metrics"]["peak_mem_bytes"],
                    "states_saving": _states(base) - _states(record), "formula_saving": formula})
    return out


def _unit(found: list[dict[str, Any]]) -> tuple[str, float]:
    """GiB for real sizes, MiB for the tiny presets' few megabytes."""
    largest = max(row["baseline"]["metrics"]["peak_mem_bytes"] for row in found)
    return ("GiB", 2.0**30) if largest >= 2**30 else ("MiB", 2.0**20)


def table(records: Iterable[dict[str, Any]]) -> str:
    """The markdown table (per rank), DDP's own rows included as the baselines."""
    found = rows(records)
    if not found:
        return "No fp32 cell implementing a ZeRO stage has a DDP cell of the same model and sizes in this run."
    unit, scale = _unit(found)

    def size(n: float) -> str:
        return f"{n / scale:.2f}"

    head = ["cell", "peak", *_CATEGORIES, "step (s)", "saving at peak",
            "states saving at the optimizer step", "ZeRO formula's saving", "states ÷ formula"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    shown_baselines: set[int] = set()
    for row in found:
        for record, is_base in ((row["baseline"], True), (row["record"], False)):
            if is_base and id(record) in shown_baselines:
                continue
            shown_baselines.add(id(record))
            m = record["metrics"]
            breakdown = m.get("mem_breakdown_bytes") or {}
            savings = (["—", "—", "—", "—"] if is_base else [
                size(row["peak_saving"]), size(row["states_saving"]), size(row["formula_saving"]),
                f"{row['states_saving'] / row['formula_saving']:.2f}" if row["formula_saving"] else "—"])
            lines.append("| " + " | ".join([
                record["cell_id"], size(m["peak_mem_bytes"]), *(size(breakdown.get(k, 0)) for k in _CATEGORIES),
                f"{m['step_time_s']:.2f}", *savings]) + " |")
    return "\n".join(lines) + (f"\n\n{unit} per rank; the categories are those held at the peak; savings are"
                               " DDP's bytes minus the row's (harness/report/savings.py).")
