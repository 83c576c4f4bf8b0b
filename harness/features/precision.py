"""Mixed precision: the autocast context and the loss scaler of a cell.

Switched-off features are no-ops, not branches in the training step (nanoGPT's habit):
fp32 gets a disabled autocast and a disabled GradScaler, so the step reads the same for all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

if TYPE_CHECKING:
    from harness.config import StrategySpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device, *, enabled: bool = True) -> AbstractContextManager:
    """Autocast for the forward pass; ``enabled=False`` where the strategy casts parameters
    itself (FSDP's mixed-precision policies) so the two mechanisms never stack."""
    return torch.autocast(
        device_type=device.type,
        dtype=DTYPES[precision],
        enabled=enabled and precision != "fp32",
    )


def keep_blocks_fp32(blocks: Iterable[nn.Module], device: torch.device) -> None:
    """Compute ``blocks`` in fp32 under autocast, the per-layer precision of mixed-precision
    recipes that keep sensitive layers (the first and last blocks, a router) in full precision:
    each block's forward runs with autocast off and its floating-point inputs cast to fp32, so
    its matmuls read the fp32 parameters themselves (nothing 16-bit is cached for them) and
    what it saves for backward is fp32. The forward is replaced on the instance, before or
    after wrapping alike: a checkpoint wrapper calls the block, and the parameters' names stay."""
    for block in blocks:
        block.forward = functools.partial(_fp32_forward, block.forward, device.type)


def _fp32_forward(forward: Callable[..., Any], device_type: str, *args: Any, **kwargs: Any) -> Any:
    def to_fp32(value: Any) -> Any:
        return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    with torch.autocast(device_type=device_type, enabled=False):
        return forward(*tree_map(to_fp32, args), **tree_map(to_fp32, kwargs))


def scales_loss(strategy: StrategySpec) -> bool:
    """Dynamic loss scaling: fp16's, unless the cell turns it off (``loss_scaling="none"``, to
    measure what fp16 loses without it); bf16 has fp32's exponent range and needs none."""
    return strategy.precision == "fp16" and strategy.loss_scaling == "dynamic"


def grad_scaler(strategy: StrategySpec, device: torch.device) -> torch.amp.GradScaler:
    """Dynamic loss scaling (scale down and skip the step on inf/nan, grow after 2000 clean
    steps) where ``scales_loss``; a disabled scaler, whose calls do nothing, elsewhere."""
    return torch.amp.GradScaler(device.type, enabled=scales_loss(strategy))


def sharded_grad_scaler(strategy: StrategySpec, device: torch.device) -> torch.amp.GradScaler:
    """``grad_scaler`` for gradients sharded over the ranks (FSDP1, FSDP2): each rank sees
    only its shard, so an inf on one rank must skip the step on all of them. torch's
    ShardedGradScaler all-reduces the found-inf flags before stepping; the plain GradScaler
    would step the other ranks' shards and leave the model inconsistent."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device.type, enabled=scales_loss(strategy))
