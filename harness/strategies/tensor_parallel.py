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
per module, not once per projection (LLaMA's q, k and v; gate and up). Without the options
below, embeddings, norms and the LM head stay replicated: each rank computes them whole on
the same samples, so their gradients agree without any communication.

Two options split more, as torchtitan's plan does (StrategySpec):
- ``sequence_parallel`` (Korthikanti et al. 2022): between the blocks' parallel regions the
  residual stream holds each rank's slice of the sequence, and the norms run on it
  (SequenceParallel: their weights are replicated DTensors, their gradients partial sums
  reduced once, ``_gradients_as_their_parameters``); each
  region's input is all-gathered and its output reduce-scattered, the same bytes as the
  all-reduce they replace. Unlike Megatron, DTensor keeps the gathered input of the column
  projections for their backward, so what the slices save is the norms' and the residual's
  activations, not the projections' inputs.
- ``loss_parallel``: the token embedding and the LM head split by vocabulary (Megatron's
  vocabulary-parallel layers; a tied pair stays one parameter), the logits left split and
  the cross-entropy taken on them under torch's loss_parallel, which all-reduces each token's
  maximum, sum and target logit instead of any rank holding s × V logits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from transformers.pytorch_utils import Conv1D

from harness import distributed, models
from harness.features import optimizers, precision
from harness.strategies import fsdp
from harness.strategies.base import FSDP_CAPABILITIES, Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from harness.config import CellSpec
    from harness.distributed import DistEnv

# Each refusal was found by trying on 2 gloo ranks (torch 2.13); the error is quoted.
_MIXED = "got mixed torch.Tensor and DTensor"
_TP_CAPABILITIES = Capabilities(
    precisions=frozenset({"fp32", "bf16"}),
    checkpointing=frozenset({"none", "full", "selective"}),
    optimizers=frozenset({"adamw", "sgd"}),
    plan_options=frozenset({"sequence_parallel", "loss_parallel"}),
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
    layout = models.param_layout(spec)
    if layout.qk_norm is not None and not layout.qk_norms_per_head:
        return (f"model={cell.model_name}: its attention's query and key norms are not one norm each of a head's"
                " channels (OLMo2's span every head, StableLM's are a module a head), which a split by heads"
                " would cut")
    degree = tp_degree(cell)
    # Every rank must hold whole (query and key/value) heads and an equal slice of the MLP.
    for field, size in (("n_heads", spec.required("n_heads")), ("n_kv_heads", spec.kv_heads), ("ffn_hidden", spec.ffn)):
        if size % degree:
            return (f"model={cell.model_name}: {field}={size} does not split over tensor-parallel degree {degree};"
                    f" choose a degree that divides {size}")
    if cell.strategy.sequence_parallel:
        if spec.tokens_per_sample % degree:
            return (f"sequence_parallel with seq_len={spec.tokens_per_sample}: the sequence does not split over"
                    f" tensor-parallel degree {degree}")
        # A norm the plan does not split would run on a slice of the sequence with whole
        # weights, each rank's gradient of them its slice's alone: a silent wrong answer.
        norms = models.param_layout(spec).block_norm_paths
        if set(norms) != set(_BLOCK_NORMS[spec.layout]):
            return (f"sequence_parallel with model={cell.model_name}: its blocks' norms ({', '.join(norms)}) are not"
                    f" the {spec.layout} plan's ({', '.join(_BLOCK_NORMS[spec.layout])})")
    if cell.strategy.loss_parallel and spec.task != "causal_lm":
        return f"loss_parallel with model={cell.model_name}: it splits a causal LM's head, and this is a {spec.task}"
    return None


# Each layout's norms in a block, which sequence parallelism splits: a model of the layout
# with others (Gemma2's norms after each sublayer, OLMo2's) is refused it.
_BLOCK_NORMS: dict[str | None, tuple[str, ...]] = {"gpt2": ("ln_1", "ln_2"),
                                                   "llama": ("input_layernorm", "post_attention_layernorm")}


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


def _gpt2_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    return _block_plan(("attn", "mlp"), _BLOCK_NORMS["gpt2"], ("attn.c_attn", "mlp.c_fc"),
                       ("attn.c_proj", "mlp.c_proj"), sequence_parallel)


# --- LLaMA -------------------------------------------------------------------------------

def _prepare_llama_block(block: nn.Module, degree: int) -> None:
    """LlamaAttention views its projections as (-1 heads, head_dim) and repeats k/v by
    num_key_value_groups, a ratio that splitting both head counts keeps; an attention that
    views them by head counts of its own (StableLM's num_heads and num_key_value_heads) gets
    its rank's."""
    attention = block.get_submodule("self_attn")
    for count in ("num_heads", "num_key_value_heads"):
        if isinstance(getattr(attention, count, None), int):
            setattr(attention, count, getattr(attention, count) // degree)


def _llama_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    # The decoder layer calls self_attn(hidden_states=...) by keyword, mlp(x) by position.
    plan = _block_plan(("self_attn", "mlp"), _BLOCK_NORMS["llama"],
                       ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
                       ("self_attn.o_proj", "mlp.down_proj"), sequence_parallel, keyword_input=frozenset({"self_attn"}))
    # Qwen3's and Gemma3's query and key norms, one head's channels each, run on the rank's
    # heads (b, s, heads, head_dim): split along the heads as a sequence-parallel norm is along
    # the sequence, their weights replicated and their gradients summed over the ranks' heads.
    attention = block.get_submodule("self_attn")
    head_norms = [f"self_attn.{name}" for name in ("q_norm", "k_norm") if hasattr(attention, name)]
    plan.update({name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in head_norms})
    return plan


# --- every layout ----------------------------------------------------------------------------

def _block_plan(regions: tuple[str, ...], norms: tuple[str, ...], column: tuple[str, ...], row: tuple[str, ...],
                sequence_parallel: bool, keyword_input: frozenset[str] = frozenset()) -> dict[str, ParallelStyle]:
    """A block's plan: each parallel region (the attention, the MLP) takes its input as one
    replicated DTensor, so that the backward reduces the input gradient once per region, not
    once per projection (LLaMA's q, k and v; gate and up); its ``column`` projections split by
    output features, its ``row`` ones by input features. Without sequence parallelism the
    region's input is whole on every rank and its output all-reduced; with it the residual
    stream between regions holds each rank's slice of the sequence: the ``norms`` run on it
    (SequenceParallel), a region's input is all-gathered and its output reduce-scattered."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    for region in regions:
        if region in keyword_input:
            plan[region] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": between},
                                              desired_input_kwarg_layouts={"hidden_states": Replicate()})
        else:
            plan[region] = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))
    plan.update({name: ColwiseParallel() for name in column})
    plan.update({name: RowwiseParallel(output_layouts=between) for name in row})
    if sequence_parallel:
        plan.update({name: SequenceParallel() for name in norms})
    return plan


def _layout_named(layout: str | None) -> str:
    return "not one harness.models.layouts recognises" if layout is None else layout


_LAYOUT_PLANS: dict[str, tuple[Callable[[nn.Module, int], None],
                               Callable[[nn.Module, bool], dict[str, ParallelStyle]]]] = {
    "gpt2": (_prepare_gpt2_block, _gpt2_plan),
    "llama": (_prepare_llama_block, _llama_plan),
}


# Where each layout's final norm is (its embeddings and LM head transformers' accessors find).
_FINAL_NORMS = {"gpt2": "transformer.ln_f", "llama": "model.norm"}


def apply_tensor_parallel(model: nn.Module, block_type: type[nn.Module], layout: str, tp_mesh: DeviceMesh, *,
                          sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """Split every ``block_type`` block over ``tp_mesh`` in place by the plan for its ``layout``
    (inside any checkpoint wrapper: the plan names modules relative to the block), then what
    lies outside the blocks as the plan options say (StrategySpec.sequence_parallel,
    loss_parallel)."""
    prepare_block, plan = _LAYOUT_PLANS[layout]
    degree = tp_mesh.size()
    blocks = [m for m in model.modules() if isinstance(m, block_type)]
    for block in blocks:
        prepare_block(block, degree)
        parallelize_module(block, tp_mesh, plan(block, sequence_parallel))
    if sequence_parallel:
        # transformers builds the positions and the causal mask from the whole sequence
        # before the first block, so the residual stream is cut there.
        blocks[0].register_forward_pre_hook(functools.partial(_slice_sequence, tp_mesh))
    hf_model = cast("PreTrainedModel", model)  # the layouts are transformers' models
    embedding, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
    tied = head.weight is embedding.weight
    names = {module: name for name, module in model.named_modules()}
    outer: dict[str, ParallelStyle] = {}
    if sequence_parallel:
        outer[_FINAL_NORMS[layout]] = SequenceParallel()
    head_input = Shard(1) if sequence_parallel else Replicate()
    if loss_parallel:
        # Each rank embeds the tokens of its slice of the vocabulary (the rest as zeros) and
        # the output is all-reduced; the head computes that slice's logits, which stay split.
        outer[names[embedding]] = RowwiseParallel(input_layouts=Replicate())
        outer[names[head]] = ColwiseParallel(input_layouts=head_input, output_layouts=Shard(-1),
                                             use_local_output=False)
        model.register_forward_hook(_local_loss)
    elif sequence_parallel:
        outer[names[head]] = PrepareModuleInput(input_layouts=(head_input,), desired_input_layouts=(Replicate(),),
                                                use_local_output=True)
    parallelize_module(model, tp_mesh, outer)
    if tied and head.weight is not embedding.weight:
        # Each style made its own parameter of the shared weight (both split by vocabulary, as
        # Shard(0)); without this the two would train apart.
        head.weight = embedding.weight


def _slice_sequence(tp_mesh: DeviceMesh, block: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The first block's input (the residual stream, positional first) cut to this rank's
    slice of the sequence; its backward all-gathers the gradient."""
    hidden, *rest = args
    whole = DTensor.from_local(hidden, tp_mesh, [Replicate()], run_check=False)
    return (whole.redistribute(tp_mesh, [Shard(1)]).to_local(), *rest)


def _gradients_as_their_parameters(model: nn.Module) -> None:
    """Each DTensor parameter's gradient laid out as the parameter is, as it is accumulated.
    FSDP2 does this for tp_fsdp as it reduces; plain tp needs it twice over:
    - a sequence-parallel norm's replicated weight gets its gradient as partial sums (each
      rank's over its slice of the sequence), which torch's optimizer would all-reduce at
      each use (AdamW and the gradient norm: three a step, measured on 2 gloo ranks): here
      once;
    - a vocabulary-parallel embedding's backward computes the whole table's gradient on every
      rank (replicated: llama-tiny's held 131,072 B for its 65,536 B slice), which would stay
      that large beside the slice it updates: here cut to the slice."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(_as_parameter)  # type: ignore[no-untyped-call]


def _as_parameter(param: torch.Tensor) -> None:
    grad = param.grad
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)


def _local_loss(model: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """The loss of vocabulary-split logits is a replicated DTensor; the training loop adds
    losses as plain tensors (its backward still runs through the DTensor's)."""
    if isinstance(output.loss, DTensor):
        output.loss = output.loss.to_local()
    return output


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
    s = cell.strategy
    apply_tensor_parallel(model, block_type, layout, mesh["tp"], sequence_parallel=s.sequence_parallel,
                          loss_parallel=s.loss_parallel)
    # torch's loss_parallel dispatches the cross-entropy of split logits, forward and backward.
    loss_context = loss_parallel if s.loss_parallel else nullcontext
    if s.name == "tp":
        _gradients_as_their_parameters(model)
        return Prepared(model=model, optimizer=optimizers.make(_param_groups(model), s.optimizer, cell.lr),
                        data_rank=0, loss_context=loss_context)
    root = _shard_over_dp(model, block_type, cell, mesh["dp"])
    return Prepared(
        model=model,
        optimizer=optimizers.make(_param_groups(model), s.optimizer, cell.lr),
        no_sync=lambda: fsdp.no_gradient_sync(root),
        loss_context=loss_context,
        use_autocast=False,
        fsdp2=True,
        scaler=precision.sharded_grad_scaler(s, env.device),
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
