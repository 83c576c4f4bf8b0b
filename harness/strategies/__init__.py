"""The strategy registry: every strategy file's declarations, and the checks that read them.

Importing this package is cheap (no torch): ``harness.config`` does, to validate cells. The
strategy files are imported on the first lookup; DeepSpeed, FairScale and Megatron-core
themselves are imported only where a strategy is prepared, since they take seconds to
import (and DeepSpeed probes for accelerators as it does).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.config import CellSpec
    from harness.strategies.base import Strategy


@functools.cache
def _declarations() -> dict[str, Strategy]:
    # The strategy files load torch: imported on the first lookup, not with this package.
    from harness.strategies import (
        context_parallel,
        data_parallel,
        ddp,
        deepspeed_zero,
        expert_parallel,
        fairscale,
        fsdp,
        fsdp1,
        megatron,
        pipeline,
        single,
        tensor_parallel,
        torch_zero,
    )

    # The order strategies are listed in (messages, help, the marker catalogue): the
    # reference, data parallelism and its sharded forms by engine, then the strategies that
    # split the model. A new strategy file is one more entry here.
    files = (single, ddp, data_parallel, torch_zero, fsdp, fsdp1, deepspeed_zero, fairscale, tensor_parallel, pipeline,
             megatron, context_parallel, expert_parallel)
    found: dict[str, Strategy] = {}
    for file in files:
        for strategy in file.STRATEGIES:
            if strategy.name in found:
                raise RuntimeError(f"strategy {strategy.name!r} is declared twice ({file.__name__})")
            found[strategy.name] = strategy
    return found


def names() -> tuple[str, ...]:
    return tuple(_declarations())


# StrategySpec's overlap knobs and the values that leave each engine at its default.
OVERLAP_DEFAULTS: dict[str, object] = {"bucket_cap_mb": None, "gradient_as_bucket_view": False, "prefetch": None,
                                       "overlap_comm": None, "optimizer_in_backward": False}


def declarations() -> tuple[Strategy, ...]:
    return tuple(_declarations().values())


def get(name: str) -> Strategy:
    """The declaration of strategy ``name``; an unknown name is refused naming the choices."""
    try:
        return _declarations()[name]
    except KeyError:
        raise ValueError(f"strategy={name!r}: choose one of {', '.join(names())}") from None


def incompatibility(cell: CellSpec) -> str | None:
    """Why this strategy cannot be combined with the cell's features on any hardware, or None.

    Such a cell is a mistake in the matrix, not a measurement: it is refused when the matrix
    is built. (Hardware limits are ``unsupported_reason`` and are recorded as results.)
    """
    s = cell.strategy
    strategy = get(s.name)
    caps = strategy.capabilities
    checks = [
        ("precision", s.precision, caps.precisions),
        ("checkpointing", s.checkpointing, caps.checkpointing),
        ("offload", s.offload, caps.offload),
        ("optimizer", s.optimizer, caps.optimizers),
        ("compression", s.compression, caps.compression),
    ]
    for axis, value, allowed in checks:
        if value not in allowed:
            why = caps.notes.get(value, f"{s.name} supports {axis} in {{{', '.join(sorted(allowed))}}}")
            return f"{s.name} with {axis}={value}: {why}"
    if problem := strategy.combination_problem(cell):
        return f"{s.name} with {problem}"
    if s.accumulation > 1 and not caps.accumulation:
        return f"{s.name} does not support gradient accumulation"
    if s.clip_grad_norm is not None and not caps.clipping:
        why = caps.notes.get("clip_grad_norm", "it does not clip gradients")
        return f"{s.name} with clip_grad_norm={s.clip_grad_norm:g}: {why}"
    if s.sync_batch_norm and not caps.sync_batch_norm:
        why = caps.notes.get("sync_batch_norm", "SyncBatchNorm is wired for DDP only")
        return f"{s.name} with sync_batch_norm=True: {why}"
    for option, default in OVERLAP_DEFAULTS.items():
        value = getattr(s, option)
        if value != default and option not in caps.overlap_options:
            takers = sorted(d.name for d in declarations() if option in d.capabilities.overlap_options)
            return f"{s.name} with {option}={value}: an option of {', '.join(takers)} only"
    for option in ("fp32_blocks", "offload_blocks"):
        if getattr(s, option) is not None and option not in caps.block_options:
            takers = sorted(d.name for d in declarations() if option in d.capabilities.block_options)
            return f"{s.name} with {option}={getattr(s, option)!r}: an option of {', '.join(takers)} only"
    for option in ("sequence_parallel", "loss_parallel"):
        if getattr(s, option) and option not in caps.plan_options:
            takers = sorted(d.name for d in declarations() if option in d.capabilities.plan_options)
            return f"{s.name} with {option}=True: an option of {', '.join(takers)} only"
    if s.local_sgd_period is not None and not caps.local_sgd:
        return f"{s.name} with local_sgd_period={s.local_sgd_period}: local SGD is wired for DDP only"
    if cell.world_size < caps.min_world_size:
        return f"{s.name} needs world_size >= {caps.min_world_size}, got {cell.world_size}"
    if caps.max_world_size is not None and cell.world_size > caps.max_world_size:
        return f"{s.name} needs world_size <= {caps.max_world_size}, got {cell.world_size}"
    return None


def _cell_option_problem(cell: CellSpec, device_type: str, installed: bool) -> str | None:
    """The hardware limits of a cell's model-structure and allocator options, any strategy
    (with ``installed``, this host's packages too)."""
    if cell.attention == "flash" and (device_type != "cuda"
                                      or (installed and importlib.util.find_spec("flash_attn") is None)):
        have = "a CUDA device without the flash-attn package" if device_type == "cuda" else f"a {device_type} device"
        return (f"attention=flash: transformers' flash_attention_2 needs a CUDA device and the flash-attn"
                f" package; this host has {have} (attention=sdpa uses torch's fused kernels)")
    if cell.strategy.checkpointing == "offload" and device_type != "cuda":
        from harness.features import checkpointing

        return checkpointing.OFFLOAD_ON_CPU
    allocator = [f"{name}={value}" for name, value, default in (
        ("expandable_segments", cell.expandable_segments, False), ("max_split_size_mb", cell.max_split_size_mb, None),
        ("garbage_collection_threshold", cell.garbage_collection_threshold, None),
        ("empty_cache", cell.empty_cache, "never")) if value != default]
    if allocator and device_type != "cuda":
        return (f"{', '.join(allocator)}: {'a setting' if len(allocator) == 1 else 'settings'} of the CUDA caching"
                f" allocator; this host computes on {device_type}, which has none")
    return None


def unsupported_reason(cell: CellSpec, device_type: str, installed: bool = True) -> str | None:
    """Why this machine cannot run the cell (recorded as an ``unsupported`` result), or None.
    ``installed=False`` asks of a ``device_type`` machine elsewhere, whose optional packages
    (flash-attn) this host cannot see: ``plan``'s target nodes."""
    from harness.features import optimizers  # the optimizer's own hardware limit, any strategy

    why = _cell_option_problem(cell, device_type, installed)
    if why:
        return why
    why = optimizers.unsupported_reason(cell.strategy.optimizer, device_type)
    if why:
        return f"optimizer={cell.strategy.optimizer}: {why}"
    return get(cell.strategy.name).unsupported_reason(cell, device_type)
