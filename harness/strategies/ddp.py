"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets
during backward, optionally through a compression hook."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from harness.features import compression, optimizers
from harness.strategies.base import Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from harness.config import CellSpec
    from harness.distributed import DistEnv


def wrap(model: nn.Module, cell: CellSpec, env: DistEnv) -> DistributedDataParallel:
    """DDP on the cell's device with its compression hook; shared with ZeRO-1."""
    model = model.to(env.device)
    bucket_cap_mb: int | None = None  # DDP's default (25 MiB)
    if compression.needs_single_bucket(cell.strategy.compression, env.backend):
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bucket_cap_mb = math.ceil(param_bytes / 2**20) + 1
    ddp_model = DistributedDataParallel(
        model, device_ids=[env.device.index] if env.is_cuda else None, bucket_cap_mb=bucket_cap_mb
    )
    compression.register(ddp_model, cell.strategy.compression, cell.strategy.powersgd_rank)
    return ddp_model


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    ddp_model = wrap(model, cell, env)
    return Prepared(
        model=ddp_model,
        optimizer=optimizers.make(ddp_model.parameters(), cell.strategy.optimizer, cell.lr),
        no_sync=ddp_model.no_sync,
    )


def unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    if cell.strategy.compression == "bf16" and device_type != "cuda":
        return "bf16_compress_hook requires CUDA 11+ and NCCL 2.10+ (gloo has no bf16 all-reduce path)"
    return None


STRATEGIES = (
    Strategy(
        name="ddp",
        summary="DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets",
        engine="torch",
        families=("ddp",),
        capabilities=Capabilities(compression=frozenset(compression.NAMES), optimizers=frozenset(optimizers.NAMES)),
        unsupported_reason=unsupported_reason,
        engine_model=EngineModel(grad_buffer="ddp_bucket", comm="all_reduce"),
        prepare=prepare,
    ),
)
