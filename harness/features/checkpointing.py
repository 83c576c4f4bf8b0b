"""Activation checkpointing of the transformer blocks: full or selective recompute, of every
block, of every k-th (``checkpoint_every``: blocks 0, k, 2k, …) or of the listed ones
(``checkpoint_blocks``): the per-layer trade of keeping some blocks' activations to recompute
less (StrategySpec.blocks says which); or activation offload, recomputing
nothing: torch's ``offload_wrapper`` runs each block under ``save_on_cpu(pin_memory=True)``,
which copies every tensor the block saves for backward to pinned host memory and back as its
backward needs it (on the compute stream; CUDA only: on a CPU the host is the device and
nothing moves, ``OFFLOAD_ON_CPU``).

Always non-reentrant: reentrant checkpointing (use_reentrant=True, fairscale's and
deepspeed's wrappers) silently drops or changes gradients on transformers-5 decoder layers
(cpu-gloo-facts.md), and the equivalence gate would rightly fail it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Selective recompute keeps the outputs of the expensive ops (matmuls, every SDPA backend
# including cuDNN's on Hopper) and recomputes the cheap element-wise ones: Korthikanti et
# al.'s trade (most of the memory back for a few percent of FLOPs).
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_mm.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


# Why activation offload is unsupported on a CPU host (strategies.unsupported_reason).
OFFLOAD_ON_CPU = ("checkpointing=offload: save_on_cpu moves what a block saves from the device to pinned host"
                  " memory; on a CPU the activations are in host memory already (a CPU tensor's .cpu() is"
                  " itself, and pinning needs CUDA), so the cell would measure no checkpointing under another name")


def apply_checkpointing(model: nn.Module, block_type: type[nn.Module], mode: str,
                        chosen: frozenset[int] | None = None) -> None:
    """Wrap each ``block_type`` submodule in place (with ``chosen``, the blocks of those
    indices in the model's order). Must run before data-parallel wrapping."""
    if mode == "none":
        return
    if mode == "offload":
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=offload_wrapper,
                                       check_fn=lambda module: isinstance(module, block_type))
        return
    kwargs: dict[str, Any] = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT}
    if mode == "selective":
        kwargs["context_fn"] = _selective_context
    blocks = [m for m in model.modules() if isinstance(m, block_type)]
    wrapped = {id(block) for index, block in enumerate(blocks) if chosen is None or index in chosen}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, **kwargs),
        check_fn=lambda module: id(module) in wrapped,
    )
