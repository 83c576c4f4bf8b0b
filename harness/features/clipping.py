"""Gradient clipping by global norm (the cell option ``clip_grad_norm``), each engine's way.

The norm is the 2-norm over every gradient of the model, wherever its pieces live:

- torch's ``clip_grad_norm_`` over the optimizer's parameters (single, DDP, torch ZeRO-1,
  tensor parallel, FSDP2): where the gradients are DTensors (FSDP2's shards, tensor
  parallel's splits) the norm is a DTensor whose ``full_tensor()`` reduces it over the mesh;
- FSDP1: ``FullyShardedDataParallel.clip_grad_norm_`` (each rank's flat shard, summed);
- FairScale OSS and ShardedDataParallel: ``OSS.clip_grad_norm`` (each rank the gradients
  of its own optimizer shard, summed);
- DeepSpeed: its config's ``gradient_clipping``, inside ``engine.step()``.

Under fp16 the gradients are unscaled first (``GradScaler.unscale_``, the AMP recipe):
clipped while still multiplied by the loss scale S, their norm is S times the true one and
the clip shrinks every update by up to S (the ``clip_before_unscale`` fault shows the
equivalence gate catching it). A ``max_norm`` of infinity measures the norm and clips nothing:
how a cell without the option still records its gradient norm where that costs no measured
step (harness/training.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from harness.distributed import is_dtensor


def torch_clip(parameters: Iterable[nn.Parameter]) -> Callable[[float], torch.Tensor]:
    """torch's clip over ``parameters``, whose gradients are plain tensors or DTensors of one
    mesh. Gradients of several kinds (tensor parallel: DTensors and plain replicated ones;
    tp_fsdp: DTensors of the 2-D mesh and of its data-parallel dimension) are refused
    together by torch's kernels ("got mixed torch.Tensor and DTensor", or a norm of DTensors
    on different meshes): their norms are then taken per kind and combined."""
    params = [p for p in parameters if p.requires_grad]

    def clip(max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        kinds: dict[object, list[torch.Tensor]] = {}
        for grad in grads:
            kinds.setdefault(grad.device_mesh if is_dtensor(grad) else None, []).append(grad)
        if len(kinds) == 1:
            norm = (torch.nn.utils.get_total_norm(grads) if math.isinf(max_norm)
                    else torch.nn.utils.clip_grad_norm_(params, max_norm))
            return _whole(norm)
        total = torch.linalg.vector_norm(torch.stack([_whole(torch.nn.utils.get_total_norm(kind))
                                                      for kind in kinds.values()]))
        if not math.isinf(max_norm):
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_coef
            for grad in grads:  # a DTensor's local shard is a view of it: scaled in place
                (grad.to_local() if is_dtensor(grad) else grad).mul_(coefficient)
        return total

    return clip


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm of DTensor gradients is itself a DTensor (partial over the mesh): reduced."""
    return norm.full_tensor() if is_dtensor(norm) else norm
