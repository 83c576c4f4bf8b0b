"""What a built model is made of, read from its modules rather than from a per-family table:
its repeated blocks (the unit of activation checkpointing, FSDP wrapping and ZeRO-3
gathering) and its layout (harness/models/spec.py, Layout), which the tensor-parallel plans,
the pipeline split and Megatron's weight copy are written for."""

from __future__ import annotations

from torch import nn

from .spec import Layout

# The submodules (relative to one block) and the path to the blocks that make each layout.
_LAYOUT_BLOCK_MODULES: dict[Layout, tuple[str, ...]] = {
    "llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "mixtral": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate", "mlp.experts"),
    "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
}
_LAYOUT_BLOCKS_AT: dict[Layout, str] = {"llama": "model.layers", "mixtral": "model.layers", "gpt2": "transformer.h"}


def repeated_blocks(module: nn.Module) -> nn.ModuleList:
    """The model's repeated layers: of its ModuleLists whose entries are all of one class, the
    one holding the most parameters (a decoder's layers, not an attention's heads or a
    block's experts). A model without one has no unit to checkpoint or shard by."""
    candidates = [m for m in module.modules()
                  if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1]
    if not candidates:
        raise ValueError(f"{type(module).__name__}: no nn.ModuleList of repeated layers; the harness checkpoints"
                         " and shards a model by its repeated blocks (README: Models)")
    return max(candidates, key=lambda m: sum(p.numel() for p in m.parameters()))


def block_type(module: nn.Module) -> type[nn.Module]:
    return type(repeated_blocks(module)[0])


def recognise(module: nn.Module) -> Layout | None:
    """The layout whose module names every block of ``module`` has, or None. Every block, not
    the first: DeepSeek's and GLM-4.5's first blocks are dense LLaMA blocks and the rest
    mixtures of experts, which no layout's tensor-parallel plan or weight copy describes."""
    blocks = repeated_blocks(module)
    names = [{name for name, _ in block.named_modules()} for block in blocks]
    at = {name for name, m in module.named_modules() if m is blocks}
    for layout, needed in _LAYOUT_BLOCK_MODULES.items():
        if _LAYOUT_BLOCKS_AT[layout] in at and all(set(needed) <= block for block in names):
            return layout
    return None
