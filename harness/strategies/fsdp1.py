"""FSDP1 (``FullyShardedDataParallel``): flat-parameter sharding, auto-wrapped per
transformer block (then the root), in its four sharding strategies; prefetch and the
all-gather limit are FSDP1's defaults (backward_prefetch BACKWARD_PRE, no forward prefetch,
limit_all_gathers). The unit and those settings are in the record's per-rank ``engine``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from harness import distributed
from harness.features import offload, optimizers, precision
from harness.features.precision import DTYPES
from harness.strategies.base import FSDP_CAPABILITIES, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from harness.config import CellSpec
    from harness.distributed import DistEnv

CAPABILITIES = dataclasses.replace(
    FSDP_CAPABILITIES,
    # 8-bit optimizers step the 1-D flat shards: quantization blocks (and bitsandbytes'
    # 4096-element threshold for 8-bit state) fall differently than on the reference's
    # per-tensor state, hence equivalence.TOLERANCE_QUANTIZED_OPTIMIZER.
    optimizers=frozenset({"adamw", "adam8bit", "adamw8bit", "paged_adamw8bit", "sgd"}),
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


def _mixed_precision(name: str) -> MixedPrecision | None:
    if name == "fp32":
        return None
    return MixedPrecision(param_dtype=DTYPES[name], reduce_dtype=torch.float32)


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    s = cell.strategy
    device_mesh: DeviceMesh | None = None  # FSDP1's default
    if s.name == "fsdp1_hybrid" and s.hsdp_mesh == "explicit":
        # Without an explicit mesh FSDP1 derives its groups from the node layout; on one node
        # that silently becomes NO_SHARD with ranks that diverge (cpu-gloo-facts.md).
        device_mesh = distributed.mesh(
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
        device_mesh=device_mesh,
    )
    return Prepared(
        model=wrapped,
        optimizer=optimizers.make(wrapped.parameters(), cell.strategy.optimizer, cell.lr),
        no_sync=wrapped.no_sync,
        use_autocast=False,
        scaler=precision.sharded_grad_scaler(cell.strategy, env.device),
        clip_grad_norm=wrapped.clip_grad_norm_,
        engine_report=lambda: engine_report(wrapped, block_type),
    )


def engine_report(wrapped: FullyShardedDataParallel, block_type: type[nn.Module]) -> dict[str, Any]:
    """FSDP1's wrapping unit and prefetch settings, for the record's per-rank ``engine``."""
    prefetch = wrapped.backward_prefetch
    return {"name": "fsdp1", "wrap_unit": f"each {block_type.__name__}, then the root",
            "units": len(FullyShardedDataParallel.fsdp_modules(wrapped)),
            "backward_prefetch": prefetch.name if prefetch is not None else None,
            "forward_prefetch": wrapped.forward_prefetch, "limit_all_gathers": wrapped.limit_all_gathers}


def unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    if cell.strategy.offload == "params" and device_type != "cuda":
        return (
            "FSDP1 CPUOffload(offload_params=True) needs an accelerator: it pins host memory"
            " ('Cannot access accelerator device when none is available')"
        )
    return None


# FSDP1 grew out of FairScale's FSDP: both keep the root unit gathered from forward to backward.
_FULLY_SHARDED = EngineModel(sharded=frozenset({"optimizer", "grads", "params"}), comm="gather_and_reduce_scatter",
                             gathers="forward_and_backward_but_root", accumulated_grads="unsharded_compute",
                             reduce_holds_unsharded_grads=True)
STRATEGIES = (
    Strategy(
        name="fsdp1_full", superseded_by="fsdp_full", summary="FSDP1 FULL_SHARD (ZeRO-3)", engine="torch",
        families=("fsdp1",), zero_idea="zero3", capabilities=CAPABILITIES, unsupported_reason=unsupported_reason,
        engine_model=_FULLY_SHARDED, prepare=prepare,
    ),
    Strategy(
        name="fsdp1_grad_op", superseded_by="fsdp_grad_op",
        summary="FSDP1 SHARD_GRAD_OP: parameters stay gathered from forward to backward",
        engine="torch", families=("fsdp1",), capabilities=CAPABILITIES, unsupported_reason=unsupported_reason,
        engine_model=dataclasses.replace(_FULLY_SHARDED, gathers="forward", keeps_gathered="always"),
        prepare=prepare,
    ),
    Strategy(
        name="fsdp1_no_shard", superseded_by="ddp",
        summary="FSDP1 NO_SHARD: DDP's replicas and all-reduce, in FSDP's wrapper",
        engine="torch", families=("fsdp1",), capabilities=CAPABILITIES, unsupported_reason=unsupported_reason,
        engine_model=EngineModel(comm="all_reduce"), prepare=prepare,
    ),
    Strategy(
        name="fsdp1_hybrid", superseded_by="fsdp_hybrid", summary="FSDP1 HYBRID_SHARD on a (replicate × shard) mesh",
        engine="torch", families=("fsdp1",), options={"hsdp_mesh": "explicit"}, capabilities=CAPABILITIES,
        unsupported_reason=unsupported_reason,
        engine_model=dataclasses.replace(_FULLY_SHARDED, shard_group="hsdp_shard"), prepare=prepare,
    ),
)
