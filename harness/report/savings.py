"""``python -m harness savings RUN``: each sharding's measured memory against DDP's, beside
the ZeRO paper's formula for the same model (Rajbhandari et al. 2020, §5; fp32 AdamW: 4 + 4 +
8 bytes per parameter, ``formulas.FP32_ADAM``), as a markdown table.

A row is an ``ok`` cell whose strategy implements a ZeRO stage (its record's ``zero_idea``),
set against the DDP cell of the same run that differs from it in the strategy alone (same
model, sizes, precision, checkpointing, offload, accumulation, optimizer). Two comparisons,
because they answer different questions:

- the saving at the peak: DDP's peak per rank minus the cell's (what decides whether a job
  fits), beside the formula's saving (``zero_model_states`` at stage 0 minus at the cell's
  stage, for the record's parameter count and world size);
- the model states each row holds at the optimizer step, everything held then but
  activations (``metrics.at_optimizer_step_bytes``: parameters, gradients, optimizer state
  and the engine's own copies in "other"), against the formula's states for its stage: the
  ratio says how many bytes per parameter the engine keeps beyond the paper's 16 (DDP's
  gradient buckets, DeepSpeed's fp32 master partition).

 fp32 AdamW cells only: under bf16 each engine keeps
its own set of copies (ZeRO's mixed-precision K = 12 describes DeepSpeed's, not FSDP2's), and
an 8-bit or factored optimizer is not Adam's 8 bytes per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from harness.predict.formulas import FP32_ADAM, zero_model_states
from harness.report import findings

_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
# Held at the optimizer step: everything but activations. "other" there is an engine's own
# copies of model state (DeepSpeed's fp32 master and parameter partitions, FSDP1's flat
# parameters), which the formula counts among the model states too.
_STATES = ("params", "grads", "optimizer", "other")
_CATEGORIES = ("params", "grads", "optimizer", "activations", "other")


def _states(record: dict[str, Any]) -> float:
    held = record["metrics"].get("at_optimizer_step_bytes") or {}
    return float(sum(held.get(k, 0) for k in _STATES))


def _formula_states(record: dict[str, Any], stage: int) -> float:
    return zero_model_states(record["model"]["n_params"], record["world_size"], stage, **FP32_ADAM).total


def rows(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per ZeRO-stage cell with a DDP baseline, in the run's order."""
    ok = [r for r in records
          if r["status"] == "ok" and r["precision"] == "fp32" and r["strategy"]["optimizer"] == "adamw"]
    ddp = {findings.pairing_key(r, findings.STRATEGY): r for r in ok if r["strategy"]["name"] == "ddp"}
    out = []
    for record in ok:
        stage = _STAGES.get(record.get("zero_idea") or "")
        base = ddp.get(findings.pairing_key(record, findings.STRATEGY))
        if stage is None or base is None:
            continue
        out.append({"record": record, "baseline": base, "stage": stage,
                    "peak_saving": base["metrics"]["peak_mem_bytes"] - record["metrics"]["peak_mem_bytes"],
                    "formula_saving": _formula_states(base, 0) - _formula_states(record, stage),
                    "states": _states(record), "formula_states": _formula_states(record, stage)})
    return out


def _unit(found: list[dict[str, Any]]) -> tuple[str, float]:
    """GiB for real sizes, MiB for the tiny presets' few megabytes."""
    largest = max(row["baseline"]["metrics"]["peak_mem_bytes"] for row in found)
    return ("GiB", 2.0**30) if largest >= 2**30 else ("MiB", 2.0**20)


def table(records: Iterable[dict[str, Any]]) -> str:
    """The markdown table (per rank), each DDP baseline once, above the cells set against it."""
    found = rows(records)
    if not found:
        return "No fp32 cell implementing a ZeRO stage has a DDP cell of the same model and sizes in this run."
    unit, scale = _unit(found)

    def size(n: float) -> str:
        return f"{n / scale:.2f}"

    head = ["cell", "peak", *_CATEGORIES, "step (s)", "saving at peak", "ZeRO formula's saving",
            "states at the optimizer step", "ZeRO formula's states", "states ÷ formula"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    shown: set[str] = set()
    for row in found:
        base_row = {"record": row["baseline"], "states": _states(row["baseline"]),
                    "formula_states": _formula_states(row["baseline"], 0)}
        for entry, is_base in ((base_row, True), (row, False)):
            record = entry["record"]
            if record["cell_id"] in shown:
                continue
            shown.add(record["cell_id"])
            m = record["metrics"]
            breakdown = m.get("mem_breakdown_bytes") or {}
            savings = ["—", "—"] if is_base else [size(row["peak_saving"]), size(row["formula_saving"])]
            lines.append("| " + " | ".join([
                record["cell_id"], size(m["peak_mem_bytes"]), *(size(breakdown.get(k, 0)) for k in _CATEGORIES),
                f"{m['step_time_s']:.2f}", *savings, size(entry["states"]), size(entry["formula_states"]),
                f"{entry['states'] / entry['formula_states']:.2f}"]) + " |")
    return "\n".join(lines) + (f"\n\n{unit} per rank; the categories are those held at the peak; a saving is DDP's"
                               " bytes minus the row's; states: everything held at the optimizer step but"
                               " activations (harness/report/savings.py).")
