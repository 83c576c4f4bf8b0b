"""The strategy registry and the up-front compatibility check of a cell.

Strategy files are imported on first use: DeepSpeed and FairScale take seconds to import
(and DeepSpeed probes for accelerators as it does), which a run of torch-native cells
should not pay.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from harness.config import CellSpec

_MODULES = {
    "single": "single",
    "ddp": "ddp",
    "zero1": "torch_zero",
    "fsdp_full": "fsdp",
    "fsdp_grad_op": "fsdp",
    "fsdp_hybrid": "fsdp",
    "fsdp1_full": "fsdp1",
    "fsdp1_grad_op": "fsdp1",
    "fsdp1_no_shard": "fsdp1",
    "fsdp1_hybrid": "fsdp1",
    "deepspeed_zero1": "deepspeed_zero",
    "deepspeed_zero2": "deepspeed_zero",
    "deepspeed_zero3": "deepspeed_zero",
    "fairscale_oss": "fairscale",
    "fairscale_sdp": "fairscale",
    "fairscale_fsdp": "fairscale",
    "tp": "tensor_parallel",
    "tp_fsdp": "tensor_parallel",
    "pp_gpipe": "pipeline",
    "pp_1f1b": "pipeline",
    "pp_interleaved_1f1b": "pipeline",
    "megatron": "megatron",
    "cp": "context_parallel",
    "deepspeed_autoep": "expert_parallel",
}


def module(name: str) -> ModuleType:
    """The strategy file implementing strategy ``name``."""
    return importlib.import_module(f"harness.strategies.{_MODULES[name]}")


def incompatibility(cell: CellSpec) -> str | None:
    """Why this strategy cannot be combined with the cell's features on any hardware, or None.

    Such a cell is a mistake in the matrix, not a measurement: it is refused when the matrix
    is built. (Hardware limits are ``unsupported_reason`` and are recorded as results.)
    """
    s = cell.strategy
    mod = module(s.name)
    # A file serving several strategies may narrow CAPABILITIES per strategy name.
    caps = mod.capabilities_for(s.name) if hasattr(mod, "capabilities_for") else mod.CAPABILITIES
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
    combination = getattr(mod, "combination_problem", None)
    if combination and (problem := combination(cell)):
        return f"{s.name} with {problem}"
    if s.accumulation > 1 and not caps.accumulation:
        return f"{s.name} does not support gradient accumulation"
    if cell.world_size < caps.min_world_size:
        return f"{s.name} needs world_size >= {caps.min_world_size}, got {cell.world_size}"
    if caps.max_world_size is not None and cell.world_size > caps.max_world_size:
        return f"{s.name} needs world_size <= {caps.max_world_size}, got {cell.world_size}"
    return None


def _cell_option_problem(cell: CellSpec, device_type: str) -> str | None:
    """The hardware limits of a cell's model-structure and allocator options, any strategy."""
    if cell.attention == "flash" and (device_type != "cuda" or importlib.util.find_spec("flash_attn") is None):
        have = "a CUDA device without the flash-attn package" if device_type == "cuda" else f"a {device_type} device"
        return (f"attention=flash: transformers' flash_attention_2 needs a CUDA device and the flash-attn"
                f" package; this host has {have} (attention=sdpa uses torch's fused kernels)")
    if cell.expandable_segments and device_type != "cuda":
        return (f"expandable_segments: a setting of the CUDA caching allocator; this host computes on"
                f" {device_type}, which has none")
    return None


def unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    """Why this machine cannot run the cell (recorded as an ``unsupported`` result), or None."""
    from harness.features import optimizers  # the optimizer's own hardware limit, any strategy

    why = _cell_option_problem(cell, device_type)
    if why:
        return why
    why = optimizers.unsupported_reason(cell.strategy.optimizer, device_type)
    if why:
        return f"optimizer={cell.strategy.optimizer}: {why}"
    check = getattr(module(cell.strategy.name), "unsupported_reason", None)
    return check(cell, device_type) if check else None
