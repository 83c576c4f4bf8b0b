"""FSDP1 (``FullyShardedDataParallel``): flat-parameter sharding, auto-wrapped per
transformer block, in its four sharding strategies."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from harness import distributed
from harness.config import CellSpec
from harness.distributed import DistEnv
from harness.features import offload, optimizers
from harness.features.precision import DTYPES
from harness.strategies.base import FSDP_CAPABILITIES, Prepared

CAPABILITIES = dataclasses.replace(
    FSDP_CAPABILITIES,
    # 8-bit optimizers step the 1-D flat shards: quantization blocks (and bitsandbytes'
    # 4096-element threshold for 8-bit state) fall differently than on the reference's
    # per-tensor state, hence equivalence.TOLERANCE_QUANTIZED_OPTIMIZER.
    optimizers=frozenset({"adamw", "adam8bit", "adamw8bit", "paged_adamw8bit"}),
    notes={
        **FSDP_CAPABILITIES.notes,
        "adafactor": (
            "FSDP1 flat parameters are 1-D: Adafactor falls back to its unfactored second"
            " moment: a different update rule than the reference's factored one (loss differs"
            " by 1.5e-4 after 10 steps) with state as large as the shard (gpt2-tiny: 270 kB"
            " per rank against 18 kB for unsharded Adafactor)"
        ),
    },
)

SHARDING = {
    "fsdp1_full": ShardingStrategy.FULL_SHARD,
    "fsdp1_grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "fsdp1_no_shard": ShardingStrategy.NO_SHARD,
    "fsdp1_hybrid": ShardingStrategy.HYBRID_SHARD,
}


def _mixed_precision(precision: str) -> MixedPrecision | None:
    if precision == "fp32":
        return None
    return MixedPrecision(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    s = cell.strategy
    kwargs = {}
    if s.name == "fsdp1_hybrid" and s.hsdp_mesh == "explicit":
        # Without an explicit mesh FSDP1 derives its groups from the node layout; on one node
        # that silently becomes NO_SHARD with ranks that diverge (cpu-gloo-facts.md).
        kwargs["device_mesh"] = distributed.mesh(
            env.device.type, distributed.hsdp_shape(env), ("replicate", "shard")
        )
    wrapped = FullyShardedDataParallel(
        model,
        sharding_strategy=SHARDING[s.name],
        auto_wrap_policy=ModuleWrapPolicy({block_type}),
        mixed_precision=_mixed_precision(s.precision),
        cpu_offload=offload.fsdp1_config(s.offload),
        # FSDP1 refuses a CPU-only run unless told the device explicitly.
        device_id=env.device,
        **kwargs,
    )
    return Prepared(
        model=wrapped,
        optimizer=optimizers.make(wrapped.parameters(), cell.strategy.optimizer, cell.lr),
        no_sync=wrapped.no_sync,
        use_autocast=False,
    )


def unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    if cell.strategy.offload == "params" and device_type != "cuda":
        return (
            "FSDP1 CPUOffload(offload_params=True) needs an accelerator: it pins host memory"
            " ('Cannot access accelerator device when none is available')"
        )
    return None
