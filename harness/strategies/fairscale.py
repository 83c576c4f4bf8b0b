"""FairScale's ZeRO family, the pre-torch-native implementations:

- fairscale_oss: ``fairscale.optim.OSS`` shards the optimizer state over the ranks (ZeRO-1);
  torch DDP still all-reduces full gradients; each rank broadcasts its updated parameters.
- fairscale_sdp: ``ShardedDataParallel`` + OSS (ZeRO-2): each gradient is reduced only to the
  rank that owns its optimizer shard.
- fairscale_fsdp: ``fairscale.nn.FullyShardedDataParallel`` (ZeRO-3), one unit per
  transformer block plus the root. It needs CUDA (streams and events throughout); on CPU it
  fails with "Torch not compiled with CUDA enabled" / KeyError 'all_gather', so it is
  recorded ``unsupported`` there.

The optimizer inside OSS is the cell's (features/optimizers.py), built by OSS on its shard.
Buffers as FairScale's defaults (README "Engine settings"): OSS's broadcast_buffer_size is
deprecated and unused (each rank broadcasts its shard's parameters); SDP's reduce_buffer_size
2**23 elements (FairScale caps it at the model's size); FairScale FSDP's bucket_cap_mb 25 and
flattened parameters. The values are in the record's per-rank ``engine``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from harness import faults
from harness.features import optimizers, precision
from harness.features.precision import DTYPES
from harness.strategies import ddp
from harness.strategies.base import Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from harness.config import CellSpec
    from harness.distributed import DistEnv

# fp16 with ShardedDataParallel takes FairScale's ShardedGradScaler: each rank keeps only the
# gradients of its own optimizer shard, so torch's GradScaler could find an inf on one rank
# and skip the step there alone. FairScale's scaler needs CUDA.
SHARDED_SCALER_NEEDS_CUDA = (
    "fp16 with ShardedDataParallel takes FairScale's ShardedGradScaler, which needs CUDA: without it"
    " the scaler disables itself ('torch.cuda.amp.GradScaler is enabled, but CUDA is not available."
    "  Disabling.') and its unscale_ moves the found-inf flags to CUDA to all-reduce them"
)

# fairscale_oss: DDP all-reduces full gradients, so every rank's GradScaler sees the same
# gradients (fp16 composes), and OSS builds any per-tensor optimizer on whole tensors.
_OSS_CAPABILITIES = Capabilities(optimizers=frozenset(optimizers.NAMES))


# Flat parameters as in torch's FSDP1 (harness/strategies/fsdp1.py): the same optimizer
# reasoning. Not run yet: it needs CUDA.
_FSDP_CAPABILITIES = dataclasses.replace(
    _OSS_CAPABILITIES,
    precisions=frozenset({"fp32", "bf16"}),
    optimizers=frozenset({"adamw", "adam8bit", "adamw8bit", "paged_adamw8bit", "sgd"}),
    notes={
        "fp16": "fp16 with FairScale FSDP needs its ShardedGradScaler: not wired in this release, use bf16",
        "adafactor": (
            "FairScale FSDP flat parameters are 1-D: Adafactor falls back to its unfactored"
            " second moment, a different update rule than the reference's factored one"
        ),
    },
)


# ShardedDataParallel's default (its signature's; its docstring's "default 0" is stale):
# small gradients are views into per-owner buckets of up to this many elements.
SDP_REDUCE_BUFFER_ELEMENTS = 2**23

FSDP_NEEDS_CUDA = (
    "FairScale FullyShardedDataParallel needs CUDA: it creates CUDA streams and events"
    " ('Torch not compiled with CUDA enabled' / KeyError 'all_gather' on CPU)"
)


def _oss(params: Iterable[nn.Parameter], cell: CellSpec) -> Any:  # fairscale.optim.OSS: untyped
    from fairscale.optim import OSS

    optimizer_class, kwargs = optimizers.optimizer_class_and_kwargs(cell.strategy.optimizer, cell.lr)
    return OSS(params, optim=optimizer_class, **kwargs)


def _prepare_oss(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    ddp_model = ddp.wrap(model, cell, env)
    optimizer = _oss(ddp_model.parameters(), cell)
    # OSS keeps the sharded state in its local optimizer: that is what the tracker must see.
    return Prepared(model=ddp_model, optimizer=optimizer, no_sync=ddp_model.no_sync,
                    memory_optimizer=optimizer.optim, clip_grad_norm=optimizer.clip_grad_norm,
                    all_reduces_kept_buffers=ddp.all_reduces_buckets(cell),
                    engine_report=lambda: ddp.engine_report(ddp_model))


def _prepare_sdp(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    from fairscale.nn.data_parallel import ShardedDataParallel

    model = model.to(env.device)
    optimizer = _oss(model.parameters(), cell)
    sdp_model = ShardedDataParallel(model, optimizer, reduce_buffer_size=SDP_REDUCE_BUFFER_ELEMENTS)
    # What FairScale made of it: 0 on one rank, else at most the model's size.
    report = {"name": "fairscale_sdp", "reduce_buffer_size": SDP_REDUCE_BUFFER_ELEMENTS,
              "reduce_buffer_elements": sdp_model._buffer_max_size}
    # SDP's reduce hooks hold references to the .grad tensors: torch 2's default
    # zero_grad(set_to_none=True) detaches them and SDP then silently reduces wrong
    # gradients (1.2-1.9x too large, cpu-gloo-facts.md). The fault kind exists so the
    # harness's tests can show the equivalence gate catching exactly that.
    set_to_none = faults.planned().get(cell.cell_id) == faults.GRADS_SET_TO_NONE
    return Prepared(model=sdp_model, optimizer=optimizer, no_sync=sdp_model.no_sync,
                    grads_set_to_none=set_to_none, memory_module=model,
                    memory_optimizer=optimizer.optim, scaler=_sharded_scaler(cell),
                    clip_grad_norm=optimizer.clip_grad_norm, engine_report=lambda: report)


def _sharded_scaler(cell: CellSpec) -> torch.amp.GradScaler:
    """FairScale's ShardedGradScaler (all-reduces the ranks' found-inf flags), for fp16."""
    from fairscale.optim.grad_scaler import ShardedGradScaler

    scaler: torch.amp.GradScaler = ShardedGradScaler(enabled=precision.scales_loss(cell.strategy))
    return scaler


def _sdp_unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    return SHARDED_SCALER_NEEDS_CUDA if cell.strategy.precision == "fp16" and device_type != "cuda" else None


def _prepare_fsdp(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    """ZeRO-3 on CUDA: each transformer block its own FSDP unit, then the root."""
    from fairscale.nn import FullyShardedDataParallel as FSDP

    s = cell.strategy
    kwargs = {"reshard_after_forward": True, "compute_device": env.device}
    if s.precision != "fp32":
        # FairScale's mixed precision: fp32 master shards, compute in compute_dtype;
        # reduce-scatter in fp32 (the FSDP recipe of harness/strategies/fsdp.py).
        kwargs.update(mixed_precision=True, compute_dtype=DTYPES[s.precision],
                      fp32_reduce_scatter=True)
    model = model.to(env.device)
    # Replace each block in its parent (not while iterating over modules()).
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, block_type)]
    for parent, name in targets:
        setattr(parent, name, FSDP(getattr(parent, name), **kwargs))
    wrapped = FSDP(model, **kwargs)
    report = {"name": "fairscale_fsdp", "wrap_unit": f"each {block_type.__name__}, then the root",
              "units": len(targets) + 1, "bucket_cap_mb": wrapped.bucket_cap_mb,
              "flatten_parameters": wrapped.flatten_parameters}
    return Prepared(
        model=wrapped,
        optimizer=optimizers.make(wrapped.parameters(), s.optimizer, cell.lr),
        no_sync=wrapped.no_sync,
        # FairScale FSDP casts parameters itself (mixed_precision / compute_dtype).
        use_autocast=False,
        clip_grad_norm=wrapped.clip_grad_norm_,
        engine_report=lambda: report,
    )


def _fsdp_unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    return FSDP_NEEDS_CUDA if device_type != "cuda" else None


STRATEGIES = (
    Strategy(
        name="fairscale_oss", superseded_by="zero1", summary="FairScale OSS over torch DDP (ZeRO-1)",
        engine="fairscale", families=("fairscale",), zero_idea="zero1",
        capabilities=dataclasses.replace(_OSS_CAPABILITIES, overlap_options=ddp.BUCKET_OPTIONS),  # over ddp.wrap
        engine_model=EngineModel(sharded=frozenset({"optimizer"}), optimizer_partition="in_order",
                                 grad_buffer="ddp_bucket", comm="all_reduce"),
        prepare=_prepare_oss,
    ),
    Strategy(
        name="fairscale_sdp", superseded_by="fsdp_grad_op", summary="FairScale ShardedDataParallel + OSS (ZeRO-2)",
        engine="fairscale", families=("fairscale",), zero_idea="zero2", capabilities=_OSS_CAPABILITIES,
        unsupported_reason=_sdp_unsupported_reason,
        # Each gradient is reduced to its owner, but the other ranks' .grad tensors stay
        # allocated: the harness zeroes them in place (set_to_none silently breaks SDP).
        engine_model=EngineModel(sharded=frozenset({"optimizer"}), optimizer_partition="in_order",
                                 comm="reduce_to_owner",
                                 grads_between_steps="zeroed"),
        prepare=_prepare_sdp,
    ),
    Strategy(
        name="fairscale_fsdp", superseded_by="fsdp_full",
        summary="FairScale FullyShardedDataParallel (ZeRO-3; CUDA only)", engine="fairscale", families=("fairscale",),
        zero_idea="zero3", capabilities=_FSDP_CAPABILITIES,
        unsupported_reason=_fsdp_unsupported_reason,
        # FSDP1 grew out of it: the same gathers, the root unit kept between forward and backward.
        engine_model=EngineModel(sharded=frozenset({"optimizer", "grads", "params"}),
                                 comm="gather_and_reduce_scatter", gathers="forward_and_backward_but_root"),
        prepare=_prepare_fsdp,
    ),
)
