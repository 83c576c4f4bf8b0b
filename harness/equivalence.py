"""The equivalence gate: does a strategy train the same model as the one-process reference?

Compared: the global mean loss of every step (warm-up included) against the reference cell
of the same model, seed, data, precision and global batch. The statistic is the largest
relative difference over steps, |loss - ref| / |ref|.

Tolerances (measured on CPU with gloo, tiny GPT-2/LLaMA presets, 10 steps):
- fp32: 1e-5. DDP, ZeRO-1, FSDP1/2 differ from the reference only by the order of
  floating-point sums (a gradient all-reduce, a sharded update).
- bf16 / fp16: 2e-2. Autocast and FSDP's parameter casting round at different places; bf16
  keeps 8 bits of mantissa (eps 7.8e-3).
- lossy gradient compression: PowerSGD approximates gradients by rank-r factors (with error
  feedback), fp16 compression rounds them: 5e-2. This checks training stays on the
  reference's trajectory, not bit-equality.
A strategy that does not synchronise (FSDP1 HYBRID_SHARD without a mesh) drifts far beyond
any of these within a few steps; tests/ prove the gate fails it.
"""

from __future__ import annotations

import math

from harness.config import CellSpec

TOLERANCE_FP32 = 1e-5
TOLERANCE_LOW_PRECISION = 2e-2
TOLERANCE_LOSSY_COMPRESSION = 5e-2


def tolerance(cell: CellSpec) -> float:
    if cell.strategy.compression in ("powersgd", "fp16", "bf16"):
        return TOLERANCE_LOSSY_COMPRESSION
    if cell.strategy.precision != "fp32":
        return TOLERANCE_LOW_PRECISION
    return TOLERANCE_FP32


def max_rel_diff(losses: list[float], reference: list[float]) -> float:
    if len(losses) != len(reference):
        return math.inf
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference)]
    return max(diffs) if all(math.isfinite(d) for d in diffs) else math.inf


def check(cell: CellSpec, losses: list[float], reference_record: dict | None) -> dict:
    ref_id = cell.reference().cell_id
    tol = tolerance(cell)
    if reference_record is None or reference_record.get("status") != "ok":
        status = "missing" if reference_record is None else reference_record["status"]
        return {"reference_cell_id": ref_id, "max_rel_loss_diff": None, "tolerance": tol,
                "passed": False, "reason": f"reference run is {status}"}
    diff = max_rel_diff(losses, reference_record["losses"])
    return {"reference_cell_id": ref_id, "max_rel_loss_diff": diff if math.isfinite(diff) else None,
            "tolerance": tol, "passed": diff <= tol, "reason": ""}
