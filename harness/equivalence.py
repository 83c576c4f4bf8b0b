"""The equivalence gate: does a strategy train the same model as the one-process reference?

Compared: the global mean loss of every step (warm-up included; a real-data cell's first
GATE_STEPS) against the reference cell of the same model, seed, data, precision and global
batch. The statistic is the largest relative difference over steps, |loss - ref| / |ref|.

Tolerances, set from the default suite on CPU with gloo (2 ranks, tiny presets, 10 steps at
lr 1e-3; reproduce with ``./run_all.sh`` and read ``equivalence.max_rel_loss_diff``):
- fp32: 1e-5. Seen: at most 2.3e-7 (DDP, ZeRO-1, FSDP1/2 in every mode, checkpointing,
  accumulation, offload): only the order of floating-point sums differs.
- bf16 / fp16, and fp16/bf16 gradient compression: 5e-4. Seen: at most 3.2e-5 (FSDP's
  parameter casting against the reference's autocast), 2.7e-6 for fp16 + GradScaler.
- bitsandbytes 8-bit optimizers (adam8bit, adamw8bit, paged_adamw8bit): 1e-4. Where the
  optimizer steps whole tensors (DDP, ZeRO-1, FairScale OSS/SDP) the 8-bit cell matches its
  8-bit reference to 2.3e-7 like fp32; where it steps FSDP1's 1-D flat shards the block-wise
  quantization blocks (and bitsandbytes' 4096-element threshold for 8-bit state) fall
  differently than on the reference's per-tensor state. Seen: 1.7e-5 (fsdp1_full and
  fsdp1_grad_op, adam8bit), 1.6e-5 (adamw8bit), 1.4e-5 (llama-tiny), 8.6e-6 (accum2),
  6.1e-6 (fsdp1_no_shard); 1.1e-5 to 1.2e-5 on DeepSpeed ZeRO-1/2/3's flat partitions;
  4.2e-5 in bf16 (under the low-precision tolerance anyway).
  torch Adafactor is not quantized: it stays at the fp32 tolerance (seen 1.5e-7).
What the gate must catch: FSDP1 HYBRID_SHARD without an explicit mesh (ranks that never
synchronise) differs by 2.0e-3 in fp32 and bf16 alike: 200× the fp32 tolerance, 4× the
low-precision one (tests/test_runs.py). Lossy compression is indistinguishable from such a
fault in ten steps of loss, which is why it is not gated (below).
FairScale ShardedDataParallel zeroing gradients with set_to_none differs by 1.7e-3 in fp32:
17× the 8-bit tolerance too (tests/test_fairscale.py).

``passed`` is None, "not gated", where the reference was predicted not to fit one GPU and so
never ran (harness/predict/fit.py; llama3-8b in the GPU matrix): the cell is measured, not shown
to train the reference's model. Also where the model has BatchNorm and the cell normalises
over fewer samples than the reference's whole batch (per rank without SyncBatchNorm, per
micro-step under accumulation: measure/batch_norm.py): a different function by design, judged
by its held-out accuracy and running statistics instead (the report's BatchNorm table). And
where the cell's gradient compression changes the update by design (PowerSGD, int8
quantization, top-k and random-k sparsification: features/compression.py UNGATED; PowerSGD
was gated at 5e-3 until it left a real-data reference's first 10 steps by 3.6e-2 on the
byte-level GPT-2, against 9.6e-4 on the synthetic tiny models): its losses leave the
reference's by construction, so it is judged by where training ends, its final held-out loss
in the convergence suite against the fp32 band (harness/convergence.py). The same for local
SGD (features/local_sgd.py), whose ranks train apart between averagings. And a mixture of
experts trained with its router's load-balancing loss (``router_aux_loss_coef``) where a
forward sees less than the whole batch (a rank's share, a micro-step, a pipeline's
micro-batch): that loss multiplies two batch statistics (each expert's share of the picks
and its mean router probability), so the mean of per-share losses is not the whole batch's,
and the gradients differ by design (moe-tiny at 0.01, DDP on 2 ranks: README "MoE load
balance"); judged by its tokens per expert instead. Where one forward sees the whole batch
(one process, no accumulation) the cell is the reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from harness.config import CellSpec
from harness.features import compression
from harness.measure import batch_norm

# The steps a real-data cell's gate compares (check).
GATE_STEPS = 10
TOLERANCE_FP32 = 1e-5
TOLERANCE_LOW_PRECISION = 5e-4
TOLERANCE_QUANTIZED_OPTIMIZER = 1e-4
QUANTIZED_OPTIMIZERS = frozenset({"adam8bit", "adamw8bit", "paged_adamw8bit", "lamb8bit"})


def tolerance(cell: CellSpec) -> float:
    if cell.strategy.precision != "fp32" or cell.strategy.compression in ("fp16", "bf16"):
        return TOLERANCE_LOW_PRECISION
    if cell.strategy.optimizer in QUANTIZED_OPTIMIZERS:
        return TOLERANCE_QUANTIZED_OPTIMIZER
    return TOLERANCE_FP32


def max_rel_diff(losses: Sequence[float | None], reference: Sequence[float | None]) -> float:
    if len(losses) != len(reference):
        return math.inf
    pairs = [(a, b) for a, b in zip(losses, reference) if a is not None and b is not None]
    if len(pairs) < len(losses):  # a non-finite loss, stored as null
        return math.inf
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in pairs]
    return max(diffs) if all(math.isfinite(d) for d in diffs) else math.inf


def _router_aux_loss_batch(cell: CellSpec) -> int | None:
    """The samples each training forward's router load-balancing loss is taken over; None
    without that loss."""
    if cell.router_aux_loss_coef is None:
        return None
    s = cell.strategy
    forwards = s.accumulation * s.data_parallel_size(cell.world_size) * (s.pp_microbatches or 1)
    return cell.global_batch // forwards


def check(cell: CellSpec, losses: list[float], reference_record: dict[str, Any] | None) -> dict[str, Any]:
    ref_id = cell.reference().cell_id
    tol = tolerance(cell)
    if reference_record is not None and reference_record.get("status") == "does_not_fit":
        # Measured, but against nothing: no one device holds the whole batch (llama3-8b's states).
        return {"reference_cell_id": ref_id, "max_rel_loss_diff": None, "tolerance": tol, "passed": None,
                "reason": f"not gated: the reference does not fit ({reference_record['reason']})"}
    changes_update = (f"compression={cell.strategy.compression}" if cell.strategy.compression in compression.UNGATED
                      else f"local_sgd_period={cell.strategy.local_sgd_period}"
                      if cell.strategy.local_sgd_period is not None else None)
    if changes_update:
        return {"reference_cell_id": ref_id, "max_rel_loss_diff": None, "tolerance": tol, "passed": None,
                "reason": (f"not gated: {changes_update} changes the update by design;"
                           " judged by its final held-out loss in the convergence suite")}
    normalised_over = batch_norm.statistics_batch(cell)
    if cell.model_spec.has_batch_norm and normalised_over != cell.global_batch:
        return {"reference_cell_id": ref_id, "max_rel_loss_diff": None, "tolerance": tol, "passed": None,
                "reason": (f"not gated: BatchNorm normalises over {normalised_over} samples here, over the whole"
                           f" batch of {cell.global_batch} in the reference (a different function by design);"
                           " judged by held-out accuracy and running statistics")}
    aux_over = _router_aux_loss_batch(cell)
    if aux_over is not None and aux_over != cell.global_batch:
        return {"reference_cell_id": ref_id, "max_rel_loss_diff": None, "tolerance": tol, "passed": None,
                "reason": (f"not gated: the router's load-balancing loss is taken over the {aux_over} samples of"
                           f" each forward here, over the whole batch of {cell.global_batch} in the reference"
                           " (a statistic of the batch, not a mean over samples); judged by its tokens per"
                           " expert (claim moe/aux_loss_balances)")}
    if reference_record is None or reference_record.get("status") != "ok":
        status = "missing" if reference_record is None else reference_record["status"]
        return {"reference_cell_id": ref_id, "max_rel_loss_diff": None, "tolerance": tol,
                "passed": False, "reason": f"reference run is {status}"}
    # Real-data cells train hundreds of steps, over which the rounding differences of equally
    # right strategies compound: the gate compares their first GATE_STEPS (the synthetic
    # cells' default length); harness/convergence.py judges where training ends.
    compared = GATE_STEPS if cell.data != "synthetic" else None
    diff = max_rel_diff(losses[:compared], reference_record["losses"][:compared])
    return {"reference_cell_id": ref_id, "max_rel_loss_diff": diff if math.isfinite(diff) else None,
            "tolerance": tol, "passed": diff <= tol, "reason": ""}
