"""BatchNorm under data parallelism and gradient accumulation (Ioffe & Szegedy 2015): what a
model with BatchNorm normalises over, and how far its running statistics end from the
whole-batch run's.

BatchNorm normalises each forward's samples by their own mean and variance, and folds those
into running estimates (momentum 0.1) that evaluation uses. A one-process run of global batch
B normalises over B. Data parallelism without SyncBatchNorm normalises each rank's micro-batch
over itself: B / (D·k) samples for D data-parallel ranks and k accumulation micro-steps (a
"virtual batch" of B built from k smaller ones normalises over each small one). SyncBatchNorm
reduces the statistics over the D ranks: B / k. So unless the statistics batch is B, the
forward is a different function from the reference's, not a reordering of the same sums: the
equivalence gate does not apply (harness/equivalence.py), and the cell is judged by its
held-out accuracy and loss (harness/convergence.py) and by the running statistics it ends with
against the whole-batch run's.

DDP broadcasts rank 0's buffers before every forward (``broadcast_buffers=True``, its default),
so what a checkpoint saved from rank 0 holds, and what ``running`` records, are rank 0's
estimates: each update from its own micro-batch alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from harness.config import CellSpec


def statistics_batch(cell: CellSpec) -> int:
    """The samples each training forward's BatchNorm normalises over (module docstring)."""
    s = cell.strategy
    data_parallel = s.data_parallel_size(cell.world_size)
    per_micro_step = cell.global_batch // s.accumulation
    return per_micro_step if s.sync_batch_norm else per_micro_step // data_parallel


def running_statistics(module: nn.Module) -> dict[str, dict[str, list[float]]]:
    """Every BatchNorm layer's running mean and variance, by the layer's name in ``module``."""
    return {name: {"running_mean": m.running_mean.tolist(), "running_var": m.running_var.tolist()}
            for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
            and m.running_var is not None}


def record(cell: CellSpec, module: nn.Module) -> dict[str, Any] | None:
    """The record's ``batch_norm``: None for a model without BatchNorm."""
    running = running_statistics(module)
    if not running:
        return None
    return {"statistics_batch": statistics_batch(cell), "global_batch": cell.global_batch,
            "sync": cell.strategy.sync_batch_norm, "running": running}


def difference(mine: dict[str, Any], reference: dict[str, Any]) -> dict[str, float | None]:
    """How far ``mine``'s running statistics are from ``reference``'s (two records'
    ``batch_norm``): for the means and the variances apart, the 2-norm of the difference over
    every layer's channels relative to the reference's 2-norm. None where the layers differ."""
    a, b = mine["running"], reference["running"]
    if a.keys() != b.keys():
        return {"running_mean": None, "running_var": None}
    out: dict[str, float | None] = {}
    for stat in ("running_mean", "running_var"):
        ours = [x for layer in a for x in a[layer][stat]]
        theirs = [x for layer in b for x in b[layer][stat]]
        norm = math.sqrt(sum(x * x for x in theirs))
        out[stat] = math.sqrt(sum((x - y) ** 2 for x, y in zip(ours, theirs))) / norm if norm else None
    return out
