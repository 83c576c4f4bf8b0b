"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets
during backward, optionally through a compression hook.

Buckets as torch's defaults (bucket_cap_mb 25 MiB, the first bucket 1 MiB) unless the cell
sets ``bucket_cap_mb`` (and ``gradient_as_bucket_view``, the buckets as the gradients' own
storage), but for PowerSGD on gloo, which needs one bucket for the whole model
(features/compression.py); the value is in the record's per-rank ``engine`` (``engine_report``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from harness.features import compression, local_sgd, optimizer_in_backward, optimizers
from harness.strategies.base import AUTOCAST_BLOCK_OPTIONS, Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from harness.config import CellSpec
    from harness.distributed import DistEnv


# torch's SyncBatchNorm runs on accelerators only; measured on CPU with torch 2.13, both ways in
# are refused (tests/test_batch_norm.py checks that these are still torch's words).
SYNC_BATCH_NORM_ON_CPU = (
    "torch's SyncBatchNorm runs on accelerators only: on this CPU, DistributedDataParallel refuses a model"
    " holding it (\"SyncBatchNorm layers only work with GPU modules\") and its forward refuses a CPU input"
    " (\"SyncBatchNorm expected input tensor to be on GPU or XPU or privateuseone\")")


# The knobs of every strategy over ``wrap`` (ddp, zero1, fairscale_oss).
BUCKET_OPTIONS = frozenset({"bucket_cap_mb", "gradient_as_bucket_view"})


def wrap(model: nn.Module, cell: CellSpec, env: DistEnv) -> DistributedDataParallel:
    """DDP on the cell's device with its compression hook (and SyncBatchNorm where the cell
    asks); shared with ZeRO-1."""
    if cell.strategy.sync_batch_norm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(env.device)
    bucket_cap_mb = cell.strategy.bucket_cap_mb  # None: DDP's default (25 MiB)
    if compression.needs_single_bucket(cell.strategy.compression, env.backend):
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bucket_cap_mb = math.ceil(param_bytes / 2**20) + 1
    ddp_model = DistributedDataParallel(
        model, device_ids=[env.device.index] if env.is_cuda else None, bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=cell.strategy.gradient_as_bucket_view,
    )
    compression.register(ddp_model, cell.strategy.compression, cell.strategy.powersgd_rank, cell.seed)
    if cell.strategy.local_sgd_period is not None:
        local_sgd.register_hook(ddp_model, cell)
    return ddp_model


def all_reduces_buckets(cell: CellSpec) -> bool:
    """Whether DDP's all-reduces take its gradient buckets themselves (Prepared.
    all_reduces_kept_buffers): with no comm hook, which would hand over a copy of its own
    making, and without gradient_as_bucket_view, where the buckets are the gradients and are
    counted as such once backward fills them. Not with SyncBatchNorm either, whose backward
    all-reduces statistics of its own."""
    s = cell.strategy
    return (s.compression == "none" and s.local_sgd_period is None and not s.optimizer_in_backward
            and not s.gradient_as_bucket_view and not s.sync_batch_norm)


def engine_report(ddp_model: DistributedDataParallel) -> dict[str, Any]:
    """The bucket sizes DDP runs with, for the record's per-rank ``engine`` (ddp, zero1 and
    fairscale_oss: every strategy over ``wrap``)."""
    return {
        "name": "torch_ddp",
        "bucket_cap_mb": ddp_model.bucket_bytes_cap / 2**20,
        # torch's default: a smaller first bucket (1 MiB) before the bucket_cap_mb ones.
        "first_bucket_smaller": bool(ddp_model.bucket_bytes_cap_default),
        "gradient_as_bucket_view": ddp_model.gradient_as_bucket_view,
    }


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    if cell.strategy.optimizer_in_backward:
        return _prepare_in_backward(model, cell, env)
    ddp_model = wrap(model, cell, env)
    optimizer = optimizers.make(ddp_model.parameters(), cell.strategy.optimizer, cell.lr)
    local = cell.strategy.local_sgd_period is not None
    return Prepared(
        model=ddp_model,
        optimizer=local_sgd.averaging_optimizer(optimizer, cell) if local else optimizer,
        memory_optimizer=optimizer if local else None,  # whose state the tracker attributes
        no_sync=ddp_model.no_sync,
        all_reduces_kept_buffers=all_reduces_buckets(cell),
        engine_report=lambda: engine_report(ddp_model),
    )


def _prepare_in_backward(model: nn.Module, cell: CellSpec, env: DistEnv) -> Prepared:
    """torch's optimizer in backward for DDP: a per-parameter optimizer on each parameter, set
    before DDP wraps the model, which then steps each bucket's parameters after its all-reduce
    (features/optimizer_in_backward.py). The loop's optimizer has nothing left to do; the
    per-parameter optimizers' state is held outside it (``memory_held``)."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    optimizer_class, kwargs = optimizers.optimizer_class_and_kwargs(cell.strategy.optimizer, cell.lr)
    model = model.to(env.device)
    _apply_optimizer_in_backward(optimizer_class, model.parameters(), kwargs)
    ddp_model = wrap(model, cell, env)
    per_parameter = [o for p in model.parameters() for o in getattr(p, "_in_backward_optimizers", [])]
    loop = optimizer_in_backward.StepsInBackward(optimizer_class(model.parameters(), **kwargs))
    return Prepared(model=ddp_model, optimizer=loop, no_sync=ddp_model.no_sync,
                    memory_held=lambda: [t for o in per_parameter for s in o.state.values() for t in s.values()
                                         if isinstance(t, torch.Tensor)],
                    engine_report=lambda: engine_report(ddp_model))


def unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    if cell.strategy.compression == "bf16" and device_type != "cuda":
        return "bf16_compress_hook requires CUDA 11+ and NCCL 2.10+ (gloo has no bf16 all-reduce path)"
    if (cell.strategy.bucket_cap_mb is not None and device_type == "cpu"
            and compression.needs_single_bucket(cell.strategy.compression, "gloo")):
        return ("PowerSGD on gloo takes one bucket of the model's size (several abort intermittently:"
                " features/compression.py), so bucket_cap_mb cannot apply")
    if cell.strategy.optimizer_in_backward and device_type != "cuda":
        return optimizer_in_backward.ON_CPU
    if cell.strategy.compression in ("int8_tensor", "int8_channel") and device_type != "cuda":
        return compression.INT8_ON_GLOO
    if cell.strategy.sync_batch_norm and device_type == "cpu":
        return SYNC_BATCH_NORM_ON_CPU
    return None


STRATEGIES = (
    Strategy(
        name="ddp",
        summary="DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets",
        engine="torch",
        families=("ddp",),
        capabilities=Capabilities(compression=frozenset(compression.NAMES), optimizers=frozenset(optimizers.NAMES),
                                  sync_batch_norm=True, local_sgd=True,
                                  overlap_options=BUCKET_OPTIONS | {"optimizer_in_backward"},
                                  block_options=AUTOCAST_BLOCK_OPTIONS),
        unsupported_reason=unsupported_reason,
        engine_model=EngineModel(grad_buffer="ddp_bucket", comm="all_reduce"),
        prepare=prepare,
    ),
)
