"""Tensor parallelism (Megatron-LM's intra-layer split, Shoeybi et al. 2019) with
torch.distributed.tensor.parallel, one plan per model layout (harness/models/spec.py, Layout).

- tp: a 1-D mesh over every rank; each rank holds 1/world of every block's matmul weights
  and every rank takes the same samples (no data parallelism).
- tp_fsdp: a 2-D ("dp", "tp") mesh of (world // tp_degree, tp_degree): tensor parallel inside
  each "tp" row, FSDP2 ``fully_shard`` over "dp" (each block, then the root), torchtitan's
  order; each "dp" index takes its own share of the samples.

In every block the attention's input projections and the MLP's first matmul are split by
output features (ColwiseParallel: each rank computes whole heads / a slice of the MLP width)
and the projections back to the hidden size by input features (RowwiseParallel: partial
sums, all-reduced in forward). The attention and MLP modules take their input as one
replicated DTensor (PrepareModuleInput), so the backward all-reduces the input gradient once
per module, not once per projection (LLaMA's q, k and v; gate and up). Embeddings, norms and
the LM head stay replicated: each rank computes them whole on the same samples, so their
gradients agree without any communication.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)
from transformers.pytorch_utils import Conv1D

from harness import distributed
from harness.features import optimizers, precision
from harness.strategies import fsdp
from harness.strategies.base import FSDP_CAPABILITIES, Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from harness.config import CellSpec
    from harness.distributed import DistEnv

# Each refusal was found by trying on 2 gloo ranks (torch 2.13); the error is quoted.
_MIXED = "got mixed torch.Tensor and DTensor"
_TP_CAPABILITIES = Capabilities(
    precisions=frozenset({"fp32", "bf16"}),
    checkpointing=frozenset({"none", "full", "selective"}),
    optimizers=frozenset({"adamw", "sgd"}),
    notes={
        "fp16": ("fp16's GradScaler unscales every gradient of a device and dtype in one kernel"
                 " (_amp_foreach_non_finite_check_and_unscale_), and tensor parallel's gradients mix"
                 f" DTensors (split weights) with plain tensors (replicated ones): '{_MIXED}'; use bf16"),
        **dict.fromkeys(("adam8bit", "adamw8bit", "paged_adamw8bit"),
                        f"bitsandbytes 8-bit optimizers do not take DTensor parameters: their update kernel fails"
                        f" with '{_MIXED}'"),
        "adafactor": ("torch.optim.Adafactor does not take tensor-parallel DTensor parameters: its column"
                      " statistic is a norm over the sharded dimension (a Partial DTensor) and the in-place"
                      " pow_ that follows has no sharding rule"),
    },
)
# tp_fsdp's gradients are all DTensors (FSDP2 shards the replicated ones too): fp16 takes
# FSDP's ShardedGradScaler.
_TP_FSDP_CAPABILITIES = dataclasses.replace(_TP_CAPABILITIES, precisions=FSDP_CAPABILITIES.precisions)
_PLANNED_LAYOUTS = ("gpt2", "llama")


def tp_degree(cell: CellSpec) -> int:
    """Ranks that split each weight: all of them for tp, the "tp" mesh dimension for tp_fsdp."""
    if cell.strategy.name == "tp":
        return cell.world_size
    return cell.strategy.layout("tp_degree")


def combination_problem(cell: CellSpec) -> str | None:
    """A model this strategy has no plan for, or whose sizes do not split over the degree."""
    spec = cell.model_spec
    if spec.layout not in _PLANNED_LAYOUTS:
        return (f"model={cell.model_name}: no tensor-parallel plan for its layout ({_layout_named(spec.layout)});"
                f" plans exist for the {' and '.join(_PLANNED_LAYOUTS)} layouts (harness/models/spec.py, Layout)")
    degree = tp_degree(cell)
    # Every rank must hold whole (query and key/value) heads and an equal slice of the MLP.
    for field, size in (("n_heads", spec.required("n_heads")), ("n_kv_heads", spec.kv_heads), ("ffn_hidden", spec.ffn)):
        if size % degree:
            return (f"model={cell.model_name}: {field}={size} does not split over tensor-parallel degree {degree};"
                    f" choose a degree that divides {size}")
    return None


# --- GPT-2 -------------------------------------------------------------------------------

def _as_linear(conv: Conv1D) -> nn.Linear:
    """The same affine map as an nn.Linear: torch's Colwise/RowwiseParallel shard nn.Linear
    (weight stored out × in), and transformers' Conv1D stores its weight in × out."""
    linear = nn.Linear(conv.nx, conv.nf, device="meta")  # parameters replaced just below
    linear.weight = nn.Parameter(conv.weight.detach().t().contiguous())
    linear.bias = nn.Parameter(conv.bias.detach().clone())
    return linear


def _rank_major_qkv(c_attn: nn.Linear, degree: int) -> None:
    """Reorder the fused projection's output features from [q | k | v] to
    [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: ColwiseParallel gives rank r the r-th contiguous chunk of
    the output features, which must hold that rank's heads of q, k and v (split as stored, rank
    0 would get all of q and rank 1 all of v)."""
    hidden = c_attn.in_features
    with torch.no_grad():
        weight = c_attn.weight.view(3, degree, hidden // degree, hidden).transpose(0, 1)
        bias = c_attn.bias.view(3, degree, hidden // degree).transpose(0, 1)
        c_attn.weight.copy_(weight.reshape(3 * hidden, hidden))
        c_attn.bias.copy_(bias.reshape(3 * hidden))


def _prepare_gpt2_block(block: nn.Module, degree: int) -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # loaded with the model (slow to import)

    if not isinstance(block, GPT2Block):
        raise TypeError(f"the gpt2 tensor-parallel plan splits transformers' GPT2Block, not {type(block).__name__}")
    attn, mlp = block.attn, block.mlp
    for parent, name in ((attn, "c_attn"), (attn, "c_proj"), (mlp, "c_fc"), (mlp, "c_proj")):
        setattr(parent, name, _as_linear(getattr(parent, name)))
    _rank_major_qkv(attn.c_attn, degree)
    # GPT2Attention splits c_attn's output into q, k, v by split_size and views heads of
    # head_dim (-1 heads): on a rank the output is [q_r k_r v_r], each embed_dim / degree wide.
    attn.split_size //= degree
    attn.embed_dim //= degree
    attn.num_heads //= degree


def _gpt2_plan() -> dict[str, ParallelStyle]:
    replicated_input = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    return {
        "attn": replicated_input,
        "attn.c_attn": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "mlp": replicated_input,
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }


# --- LLaMA -------------------------------------------------------------------------------

def _prepare_llama_block(block: nn.Module, degree: int) -> None:
    """Nothing to change: LlamaAttention views its projections as (-1 heads, head_dim) and
    repeats k/v by num_key_value_groups, a ratio that splitting both head counts keeps."""


def _llama_plan() -> dict[str, ParallelStyle]:
    return {
        # The decoder layer calls self_attn(hidden_states=...) by keyword, mlp(x) by position.
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def _layout_named(layout: str | None) -> str:
    return "not one harness.models.layouts recognises" if layout is None else layout


_LAYOUT_PLANS: dict[str, tuple[Callable[[nn.Module, int], None], Callable[[], dict[str, ParallelStyle]]]] = {
    "gpt2": (_prepare_gpt2_block, _gpt2_plan),
    "llama": (_prepare_llama_block, _llama_plan),
}


def apply_tensor_parallel(model: nn.Module, block_type: type[nn.Module], layout: str, tp_mesh: DeviceMesh) -> None:
    """Split every ``block_type`` block over ``tp_mesh`` in place by the plan for its ``layout``
    (inside any checkpoint wrapper: the plan names modules relative to the block)."""
    prepare_block, plan = _LAYOUT_PLANS[layout]
    degree = tp_mesh.size()
    for block in [m for m in model.modules() if isinstance(m, block_type)]:
        prepare_block(block, degree)
        parallelize_module(block, tp_mesh, plan())


# --- the strategies ----------------------------------------------------------------------

def _mesh(cell: CellSpec, env: DistEnv) -> DeviceMesh:
    if cell.strategy.name == "tp":
        return distributed.mesh(env.device.type, (env.world_size,), ("tp",))
    degree = tp_degree(cell)
    return distributed.mesh(env.device.type, (env.world_size // degree, degree), ("dp", "tp"))


def _shard_over_dp(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, dp_mesh: DeviceMesh) -> FSDPModule:
    """FSDP2 over the data-parallel dimension, each block then the root (as fsdp.py); the
    root as fully_shard returns it (``model`` itself)."""
    mp_policy = fsdp.mixed_precision_policy(cell.strategy.precision)
    for module in model.modules():
        if isinstance(module, block_type):
            fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy)
    return fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Split (DTensor) and replicated (plain) parameters in separate optimizer groups: the
    foreach and fused AdamW kernels (the default on CUDA) step a group in one call, which fails
    on a mix ('got mixed torch.Tensor and DTensor'). The update rule is per parameter, so the
    grouping changes no number. (Under FSDP2 every parameter is a DTensor: one group.)"""
    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": group} for group in groups if group]


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    mesh = _mesh(cell, env)  # through distributed.mesh: one per process group, built outside a trace's fake mode
    model = model.to(env.device)
    layout = cell.model_spec.layout
    if layout is None:  # combination_problem refused the cell before launch
        raise ValueError(f"model={cell.model_name}: no tensor-parallel plan for its layout")
    apply_tensor_parallel(model, block_type, layout, mesh["tp"])
    if cell.strategy.name == "tp":
        return Prepared(model=model, optimizer=optimizers.make(_param_groups(model), cell.strategy.optimizer, cell.lr),
                        data_rank=0)
    root = _shard_over_dp(model, block_type, cell, mesh["dp"])
    return Prepared(
        model=model,
        optimizer=optimizers.make(_param_groups(model), cell.strategy.optimizer, cell.lr),
        no_sync=lambda: fsdp.no_gradient_sync(root),
        use_autocast=False,
        fsdp2=True,
        scaler=precision.sharded_grad_scaler(cell.strategy, env.device),
        data_rank=mesh.get_local_rank("dp"),
    )


def _tp_fsdp_layout_problem(cell: CellSpec) -> str | None:
    degree = tp_degree(cell)
    if cell.world_size % degree or cell.world_size == degree:
        return (f"world_size={cell.world_size} with tp_fsdp tp_degree={degree}: the world size must be a multiple"
                f" of tp_degree with at least 2 data-parallel groups ({2 * degree}, {3 * degree}, ...)")
    return None


# The inner (tensor-parallel) dimension of tp_fsdp's 2-D mesh, unless a cell sets tp_degree.
DEFAULT_TP_DEGREE = 2
STRATEGIES = (
    Strategy(
        name="tp", summary="tensor parallel over all ranks (torch's Colwise/Rowwise plans)", engine="torch",
        splits_batch=False, capabilities=_TP_CAPABILITIES, combination_problem=combination_problem,
        engine_model=EngineModel(analytic="tensor_parallel"), prepare=prepare,
    ),
    Strategy(
        name="tp_fsdp", summary="tensor parallel inside tp_degree-sized groups, FSDP2 over the groups (2-D mesh)",
        engine="torch", families=("tp", "fsdp"), options={"tp_degree": DEFAULT_TP_DEGREE},
        capabilities=_TP_FSDP_CAPABILITIES, combination_problem=combination_problem,
        layout_problem=_tp_fsdp_layout_problem,
        # FSDP2 shards each rank's tensor-parallel part over the data-parallel groups; its root
        # (fully_shard's default) stays gathered from forward to backward, and its micro-steps
        # without gradient sync hold that part's gradients unsharded, in fp32 (as fsdp.py's).
        engine_model=EngineModel(analytic="tensor_parallel", sharded=frozenset({"optimizer", "grads", "params"}),
                                 gathers="forward_and_backward_but_root", accumulated_grads="unsharded_fp32"),
        prepare=prepare,
    ),
)
