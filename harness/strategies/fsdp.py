"""FSDP2 (``fully_shard``): per-parameter sharding with DTensor, one shard unit per
transformer block plus the root (torch's own recipe, as torchtitan applies it); FSDP2 has no
bucket to size: each unit's parameters are gathered, and its gradients reduce-scattered, as
one collective, with torch's implicit prefetch of the next unit; a cell's ``prefetch`` N
sets each block's explicit prefetch to the next N blocks in forward and the N before it in
backward (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``, as
torchtitan does), so up to N + 1 blocks are gathered at once. The unit is in the record's
per-rank ``engine``.

- fsdp_full: reshard after forward (ZeRO-3: parameters gathered again in backward)
- fsdp_grad_op: keep parameters unsharded between forward and backward (ZeRO-2-like)
- fsdp_hybrid: HSDP on a 2-D (replicate × shard) mesh
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypedDict, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from harness import distributed
from harness.features import offload, optimizers, precision
from harness.features.precision import DTYPES
from harness.strategies.base import FSDP_CAPABILITIES, EngineModel, ModelState, Prepared, Strategy

if TYPE_CHECKING:
    from harness.config import CellSpec
    from harness.distributed import DistEnv

# FSDP2 parameters are DTensors; what the optimizer does with them decides what composes.
_NO_DTENSOR_8BIT = (
    "bitsandbytes 8-bit optimizers do not take DTensor parameters (FSDP2): their update kernel"
    " fails with 'got mixed torch.Tensor and DTensor'"
)
CAPABILITIES = dataclasses.replace(
    FSDP_CAPABILITIES,
    optimizers=frozenset({"adamw", "sgd"}),
    overlap_options=frozenset({"prefetch"}),
    block_options=frozenset({"fp32_blocks", "offload_blocks"}),
    # One rank is a real configuration (one GPU: the device check); FSDP1's share the rest.
    min_world_size=1,
    notes={
        **FSDP_CAPABILITIES.notes,
        "adam8bit": _NO_DTENSOR_8BIT,
        "adamw8bit": _NO_DTENSOR_8BIT,
        "paged_adamw8bit": _NO_DTENSOR_8BIT,
        "adafactor": (
            "torch.optim.Adafactor does not take FSDP2's Shard(0) DTensor parameters: its"
            " column statistic is a norm over the sharded dimension (a Partial DTensor) and the"
            " in-place pow_ that follows has no sharding rule ('Sharding propagation failed for"
            " aten.pow_.Scalar')"
        ),
    },
)


def _mesh(cell: CellSpec, env: DistEnv) -> DeviceMesh:
    if cell.strategy.name == "fsdp_hybrid":
        return distributed.mesh(env.device.type, distributed.hsdp_shape(env), ("replicate", "shard"))
    return distributed.mesh(env.device.type, (env.world_size,), ("shard",))


def mixed_precision_policy(name: str) -> MixedPrecisionPolicy:
    if name == "fp32":
        return MixedPrecisionPolicy()
    # Compute in low precision, reduce gradients in fp32 (the usual recipe: bf16 sums of
    # many ranks' gradients lose too many bits).
    return MixedPrecisionPolicy(param_dtype=DTYPES[name], reduce_dtype=torch.float32)


@contextmanager
def no_gradient_sync(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class _ShardKwargs(TypedDict):
    """fully_shard's keyword arguments, the same for every unit."""

    mesh: DeviceMesh
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy


def _prefetch(blocks: list[FSDPModule], depth: int) -> None:
    """Each block gathers the next ``depth`` blocks as its forward starts and the ``depth``
    before it (nearest first) as its backward starts."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - depth):i][::-1])


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    s = cell.strategy
    if s.offload == "none":
        model = model.to(env.device)  # with offload, parameters stay in host memory
    shard_kwargs: _ShardKwargs = {
        "mesh": _mesh(cell, env),
        "reshard_after_forward": s.name != "fsdp_grad_op",
        "mp_policy": mixed_precision_policy(s.precision),
        "offload_policy": offload.fsdp2_policy(s.offload, env.device),
    }
    blocks = [module for module in model.modules() if isinstance(module, block_type)]
    # Per-module policies: the listed blocks gathered in fp32 (their inputs cast to fp32 too),
    # or kept in host memory with their gradients and optimizer state.
    fp32, offloaded = s.blocks("fp32_blocks", len(blocks)), s.blocks("offload_blocks", len(blocks))
    for i, block in enumerate(blocks):
        block_kwargs = shard_kwargs.copy()
        if i in fp32:
            # Inputs cast to fp32 (a policy without a param_dtype would leave them 16-bit) and
            # the output back, for the 16-bit modules after it (the final norm's weight).
            block_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                                             output_dtype=DTYPES[s.precision])
        if i in offloaded:
            block_kwargs["offload_policy"] = offload.fsdp2_policy("params", env.device)
        fully_shard(block, **block_kwargs)
    root = fully_shard(model, **shard_kwargs)  # model itself, now an FSDPModule too
    if s.prefetch is not None:
        _prefetch(cast(list[FSDPModule], blocks), s.prefetch)
    report = {"name": "fsdp2", "wrap_unit": f"each {block_type.__name__}, then the root",
              "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
              "prefetch": s.prefetch or "implicit (the next unit)",
              **({"fp32_blocks": sorted(fp32)} if fp32 else {}),
              **({"offloaded_blocks": sorted(offloaded)} if offloaded else {})}
    return Prepared(
        model=model,
        optimizer=optimizers.make(model.parameters(), cell.strategy.optimizer, cell.lr),
        no_sync=lambda: no_gradient_sync(root),
        use_autocast=False,
        fsdp2=True,
        scaler=precision.sharded_grad_scaler(cell.strategy, env.device),
        engine_report=lambda: report,
    )


_FULLY_SHARDED: frozenset[ModelState] = frozenset({"optimizer", "grads", "params"})
STRATEGIES = (
    Strategy(
        name="fsdp_full",
        summary="FSDP2 fully_shard, resharding after forward (ZeRO-3: parameters gathered again in backward)",
        engine="torch", families=("fsdp",), zero_idea="zero3", capabilities=CAPABILITIES,
        engine_model=EngineModel(sharded=_FULLY_SHARDED, comm="gather_and_reduce_scatter",
                                 accumulated_grads="unsharded_fp32"),
        prepare=prepare,
    ),
    Strategy(
        name="fsdp_grad_op",
        summary="FSDP2 fully_shard keeping parameters unsharded between forward and backward (ZeRO-2-like)",
        engine="torch", families=("fsdp",), zero_idea="zero2", capabilities=CAPABILITIES,
        # Gathered from forward to the end of backward, resharded after it: at the optimizer
        # step it holds ZeRO-3's layout.
        engine_model=EngineModel(sharded=_FULLY_SHARDED, comm="gather_and_reduce_scatter", gathers="forward",
                                 keeps_gathered="always", accumulated_grads="unsharded_fp32"),
        prepare=prepare,
    ),
    Strategy(
        name="fsdp_hybrid",
        summary="FSDP2 fully_shard as HSDP on a 2-D (replicate × shard) mesh",
        engine="torch", families=("fsdp",), capabilities=CAPABILITIES,
        engine_model=EngineModel(sharded=_FULLY_SHARDED, shard_group="hsdp_shard", comm="gather_and_reduce_scatter",
                                 accumulated_grads="unsharded_fp32"),
        prepare=prepare,
    ),
)
