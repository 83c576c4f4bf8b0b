"""The analytic model of a data-parallel or sharded cell (DDP, torch ZeRO-1, FSDP2, FSDP1,
DeepSpeed ZeRO, FairScale), per rank: ZeRO's formulas with what each engine keeps in which
precision, its buffers and collectives, what offload moves to the host and what exists only
during forward and backward. Also a cell's activations (Korthikanti et al.), which the
model-parallel parts (analytic_parallel.py) reuse.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import TYPE_CHECKING, Literal

import torch

from harness import models, strategies
from harness.config import CellSpec
from harness.distributed import DistEnv, hsdp_shape
from harness.features import compression, sparsification
from harness.features.optimizers import BITSANDBYTES
from harness.models import ModelSpec, hf_config, sources
from harness.predict import zero3_residency
from harness.predict.formulas import (
    activation_bytes_per_layer,
    adafactor_state_bytes,
    adamw_state_bytes,
    blockwise_8bit_state_bytes,
    lamb_state_bytes,
    powersgd_elements,
    sgd_momentum_state_bytes,
)
from harness.predict.formulas.compression import int8_allgather_bytes, sparsified_bytes
from harness.strategies import ddp, deepspeed_zero  # their rules; DeepSpeed itself is imported on use
from harness.strategies.base import EngineModel

if TYPE_CHECKING:  # types only: importing them loads every model family and transformers
    from harness.models import NormKeeps, ParamLayout

SPARSIFIED = ("topk", "randomk")
# Bytes of one value in the cell's compute precision.
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _engine(cell: CellSpec) -> EngineModel:
    """What the cell's strategy declares of how its engine holds and moves the model."""
    return strategies.get(cell.strategy.name).engine_model


def shard_degree(cell: CellSpec, nodes: int = 1) -> int:
    """Ranks a sharded state is split over: the world, or the shard dimension of HSDP."""
    if _engine(cell).shard_group == "hsdp_shard":
        # hsdp_shape reads the world size and the node count only.
        env = DistEnv(rank=0, world_size=cell.world_size, nnodes=nodes, device=torch.device("cpu"), backend="")
        return hsdp_shape(env)[1]
    return cell.world_size


def tensor_parallel_degree(cell: CellSpec) -> int:
    """Ranks a tensor-parallel group splits each layer over: every rank for tp, the inner
    mesh dimension for tp_fsdp, Megatron's tensor-parallel size for megatron, 1 otherwise."""
    s = cell.strategy
    if s.tp_degree is not None:
        return s.tp_degree
    return cell.world_size if _engine(cell).analytic == "tensor_parallel" else 1


def _ds_sizes(cell: CellSpec) -> dict[str, int]:
    """The ZeRO-3 sizes harness/strategies/deepspeed_zero.py configures for the cell's model."""
    return deepspeed_zero.zero_sizes(deepspeed_zero.model_hidden(cell), 3)


def persistent_numel(cell: CellSpec, layout: ParamLayout) -> int:
    """Elements every rank keeps whole beside their shard: DeepSpeed ZeRO-3's persistent
    parameters (those within stage3_param_persistence_threshold); 0 for other engines."""
    if _engine(cell).persistent_params == "none":
        return 0
    sizes = _ds_sizes(cell)
    return deepspeed_zero.persistent_numel(layout.shapes, sizes["stage3_param_persistence_threshold"],
                                           sizes["stage3_model_persistence_threshold"])


def optimizer_state_bytes(shapes: list[tuple[int, ...]] | tuple[tuple[int, ...], ...], optimizer: str) -> float:
    """Bytes of optimizer state for fp32 parameters of the given shapes under the cell's
    optimizer (harness/features/optimizers.py), by its paper's formula."""
    if optimizer == "adamw":
        return adamw_state_bytes(shapes)
    if optimizer in ("lamb", "lamb8bit"):
        return lamb_state_bytes(shapes, eight_bit=optimizer == "lamb8bit")
    if optimizer == "fused_lamb":  # DeepSpeed's FusedLamb: the two fp32 moments, its step count a Python int
        return lamb_state_bytes(shapes, eight_bit=False, update_norms=False)
    if optimizer in BITSANDBYTES:
        return blockwise_8bit_state_bytes(shapes)
    if optimizer == "adafactor":
        return adafactor_state_bytes(shapes)
    if optimizer == "sgd":
        return sgd_momentum_state_bytes(shapes)
    raise ValueError(f"optimizer={optimizer!r}: no state formula")


def model_states_at_step(cell: CellSpec, layout: ParamLayout, nodes: int = 1) -> dict[str, float]:
    """Bytes per rank held when the optimizer step begins, by category.

    ZeRO's formulas with the cell's engine's byte counts: torch's autocast and FSDP's
    mixed-precision policies keep fp32 parameters and gradients (no master copy: K = the
    optimizer's own state); DeepSpeed keeps parameters and gradients in the compute
    precision and an fp32 master partition (K = 4 + the optimizer's state), as the paper.
    ``buffers``: DDP's flat gradient bucket (one gradient-sized copy; torch DDP,
    ZeroRedundancyOptimizer + DDP, FairScale OSS + DDP; none with gradient_as_bucket_view, where
    the gradients are views of it), and under top-k or random-k two
    more: the error-feedback memory and the hook's averaged result, which DDP's reducer
    keeps until the next step's replaces it (measured on the tiny presets' one bucket);
    DeepSpeed ZeRO-3's gradient reduce bucket, which stays allocated between steps
    (reduce_bucket_size elements: h² for hidden size h, as harness/strategies/deepspeed_zero.py
    configures it). ZeRO-3's persistent
    parameters are held whole on every rank beside their partitions (``params``).
    """
    s, engine = cell.strategy, _engine(cell)
    degree = shard_degree(cell, nodes)
    psi = layout.numel
    opt = optimizer_state_bytes(layout.shapes, s.optimizer)
    if engine.fp32_master_partition:
        param_bytes = grad_bytes = PRECISION_BYTES[s.precision]
        opt += 4 * psi  # the fp32 master partition
    else:
        param_bytes = grad_bytes = 4

    def per_rank(nbytes: float, kind: str) -> float:
        return nbytes / degree if kind in engine.sharded else nbytes

    # The optimizer in backward frees each gradient as soon as it is applied: none is left
    # when the step would begin (features/optimizer_in_backward.py).
    grads = 0.0 if s.optimizer_in_backward else psi * grad_bytes
    buffers = 0.0
    if engine.grad_buffer == "ddp_bucket":
        # gradient_as_bucket_view: the gradients are views of the bucket, no second copy.
        copies = (0 if s.gradient_as_bucket_view else 1) + (2 if s.compression in SPARSIFIED else 0)
        buffers = psi * grad_bytes * copies
    elif engine.grad_buffer == "deepspeed_reduce_bucket":
        buffers = _ds_sizes(cell)["reduce_bucket_size"] * grad_bytes
    return {
        "params": per_rank(psi * param_bytes, "params") + persistent_numel(cell, layout) * param_bytes,
        "grads": per_rank(grads, "grads"),
        "optimizer": (per_rank(opt, "optimizer") if engine.optimizer_partition == "even"
                      else _fullest_rank_state(layout, s.optimizer, degree, engine.optimizer_partition)),
        "buffers": buffers,
    }


def _fullest_rank_state(layout: ParamLayout, optimizer: str, degree: int,
                        partition: Literal["largest_first", "in_order"]) -> float:
    """The optimizer state of the rank holding the most, where each rank steps whole tensors
    (``_whole_tensor_states``). The record's peak is the fullest rank's: gpt2-124m's token
    table, 31 % of its parameters, is one rank's whole share at 8 ranks."""
    return max(_whole_tensor_states(layout, optimizer, degree, partition))


def fullest_optimizer_rank(cell: CellSpec) -> int:
    """The rank holding the most optimizer state where the cell's engine deals out whole
    tensors (EngineModel.optimizer_partition; the first on a tie), else 0: the rank the
    traced predictor steps beside rank 0 (harness/predict/traced.py)."""
    partition = _engine(cell).optimizer_partition
    if partition == "even":
        return 0
    held = _whole_tensor_states(models.param_layout(cell.model_spec), cell.strategy.optimizer,
                                shard_degree(cell), partition)
    return held.index(max(held))


def _whole_tensor_states(layout: ParamLayout, optimizer: str, degree: int,
                         partition: Literal["largest_first", "in_order"]) -> list[float]:
    """Each rank's optimizer state bytes where each tensor goes to the rank holding the fewest
    elements so far, in the engine's order (EngineModel.optimizer_partition; the first such
    rank on a tie, as both engines pick)."""
    shapes = sorted(layout.shapes, key=math.prod, reverse=True) if partition == "largest_first" else layout.shapes
    held: list[list[tuple[int, ...]]] = [[] for _ in range(degree)]
    sizes = [0] * degree
    for shape in shapes:
        rank = sizes.index(min(sizes))
        held[rank].append(shape)
        sizes[rank] += math.prod(shape)
    return [optimizer_state_bytes(rank_shapes, optimizer) for rank_shapes in held]


def attention_is_fused(cell: CellSpec) -> bool:
    """SDPA and flash kernels keep no s×s score matrix; eager attention keeps the softmax
    output for its backward (Korthikanti's 5·a·s²·b term; Dao et al. 2022, FlashAttention)."""
    return cell.attention != "eager"


def activation_bytes(cell: CellSpec, spec: ModelSpec, device_type: str = "cuda") -> dict[str, float]:
    """Korthikanti's per-layer activations × layers for one micro-batch, plus the logits;
    under full checkpointing each block's input alone, under the harness's selective
    recompute what ``_selective_per_layer`` says.

    Text and ViT transformers only (the MLP model has no attention: 0). The models here run
    without dropout; activations are fp32 under fp32 and, under autocast, mostly 16-bit. The
    logits term is the fp32 s·b·V output of the LM head that the loss keeps (HF upcasts
    logits to fp32), which Korthikanti leaves out.
    The attention follows ``cell.attention``: fused (sdpa, flash) keeps no scores and takes
    grouped K and V as they are, unless SDPA is handed a mask (``_masked_blocks``); eager keeps
    the softmax output, and transformers expands grouped K and V to every head (repeat_kv)
    before its score matmuls, so it keeps them full width. A tensor-parallel cell divides the
    TP region's terms by its degree (no sequence parallelism); a mixture of experts keeps each
    token's expert MLP terms top_k times.
    The norms read the residual stream, which stays fp32 under autocast (the embeddings
    are not cast, and fp32 + 16-bit adds to fp32) and is 16-bit only where the engine casts
    the model; LLaMA's and Mixtral's RMSNorms keep more than a LayerNorm (measured: NormKeeps),
    and under autocast LLaMA's separate projections each keep their own cast input.
    A decoder's ``logits`` term also holds what its head keeps: the final norm's tensors
    and the head's input, a masked LM's its embeddings' norm and its head's transform
    (``_head_keeps``). Where a model's blocks differ (DeepSeek's dense first blocks before
    its mixtures of experts) each kind counts at its own size, and ``per_layer`` is the
    largest kind's. ``device_type`` decides which attention kernel SDPA runs
    (``_fused_kernel``).
    """
    if spec.family == "mlp":
        return {"per_layer": 0.0, "layers": 0.0, "logits": 0.0}
    if spec.family == "convnet":
        # A block keeps its convolution's output (BatchNorm's input) and its ReLU's output
        # (ReLU's backward reads it; the next convolution's input is the same tensor); the
        # classifier keeps its pooled input, the loss its fp32 log-probabilities.
        per_layer = 2.0 * 4 * cell.micro_batch * spec.hidden * spec.required("image_size") ** 2
        return {"per_layer": per_layer, "layers": per_layer * spec.n_layers,
                "logits": 4.0 * cell.micro_batch * (spec.hidden + spec.required("num_classes"))}
    kinds = _block_kinds(cell, spec)
    uniform = len({kind[:2] for kind in kinds}) == 1  # no per-layer option: each block as the cell
    own = {kind[2:]: _block_bytes(cell, spec, *kind[2:], device_type) for kind in kinds}  # as the cell
    layers = sum(n * (own[experts, masked] if uniform
                      else _block_bytes(as_block(cell, checkpointed, fp32), spec, experts, masked, device_type))
                 for (checkpointed, fp32, experts, masked), n in kinds.items())
    per_layer = max(own.values())
    value_bytes = PRECISION_BYTES[cell.strategy.precision]
    norm = _mean_keeps(_block_norms(spec), _residual_bytes(cell))
    tokens_wide = spec.tokens_per_sample * cell.micro_batch * spec.hidden
    head = _head_keeps(cell, spec, norm / sequence_slices(cell), value_bytes, device_type) * tokens_wide
    return {"per_layer": per_layer, "layers": layers, "logits": _kept_logits_bytes(cell, spec) + head}


def _head_keeps(cell: CellSpec, spec: ModelSpec, norm: float, value_bytes: int, device_type: str) -> float:
    """Bytes per hidden element of every token that a language model keeps outside its blocks
    (``activation_bytes``' head): a decoder its final norm's and its head's input; a masked LM
    its embeddings' norm and its head's transform, a dense layer, an activation and a
    LayerNorm before the decoder, each keeping its input (BertForMaskedLM's saved tensors).
    The transform's LayerNorm reads the activation's 16-bit output under autocast, which
    CUDA's autocast runs in fp32 (keeping the cast copy) and the CPU's in the input's dtype."""
    if spec.task == "causal_lm":
        return norm + value_bytes
    if spec.task == "masked_lm":
        transform_norm = 4 if uses_autocast(cell) and device_type == "cuda" else value_bytes
        return norm + 3 * value_bytes + transform_norm
    return 0.0


def _mean_keeps(norms: tuple[NormKeeps, ...], input_bytes: int) -> float:
    """What a block's norms keep per element of their input, on average (the formula counts
    ``norms`` inputs at one value each; the final norm is taken for one of them)."""
    return sum(norm.at(input_bytes) for norm in norms) / len(norms)


def _block_norms(spec: ModelSpec) -> tuple[NormKeeps, ...]:
    """What a block's norms keep (two LayerNorms' where the layout does not say)."""
    return models.param_layout(spec).block_norms or (models.LAYERNORM_KEEPS,) * 2


def sequence_slices(cell: CellSpec) -> int:
    """Slices of the sequence the residual stream and the norms hold between the blocks'
    tensor-parallel regions: the degree under sequence parallelism, else 1."""
    return tensor_parallel_degree(cell) if cell.strategy.sequence_parallel else 1


def vocabulary_slices(cell: CellSpec) -> int:
    """Slices of the vocabulary the token table, the LM head and the logits are split into:
    the tensor-parallel degree under ``loss_parallel``, else 1."""
    return tensor_parallel_degree(cell) if cell.strategy.loss_parallel else 1


def _residual_bytes(cell: CellSpec) -> int:
    """Bytes of a residual-stream value: fp32 under fp32 and under autocast, else the precision
    the engine casts the model to."""
    if cell.strategy.precision == "fp32" or uses_autocast(cell):
        return 4
    return PRECISION_BYTES[cell.strategy.precision]


def _block_bytes(cell: CellSpec, spec: ModelSpec, experts: bool, masked: bool, device_type: str) -> float:
    """What one block keeps (``activation_bytes``' per layer): a mixture-of-experts block where
    ``experts``, else a dense one (``ParamLayout.dense_ffn`` wide where the model has both);
    one whose attention SDPA gets with a mask where ``masked`` (``_masked_blocks``)."""
    layout = models.param_layout(spec)
    latent = layout.latent_attention
    fused = _fused_kernel(cell, spec, device_type)
    heads = spec.required("n_heads")
    value_bytes = PRECISION_BYTES[cell.strategy.precision]
    autocast = uses_autocast(cell)
    residual_bytes = _residual_bytes(cell)
    block_norms = _block_norms(spec)
    norm = _mean_keeps(block_norms, residual_bytes)
    mode = cell.strategy.checkpointing
    if mode == "full":  # the block's input alone, from the residual stream
        return residual_bytes * spec.tokens_per_sample * cell.micro_batch * spec.hidden / sequence_slices(cell)
    if mode == "selective":
        return _selective_per_layer(cell, spec, value_bytes, residual_bytes, experts, device_type)
    # Attention and MLP side by side behind one norm (Cohere) read the same input: kept once,
    # but for autocast's own copies.
    attention_in, mlp_in = layout.input_linears if autocast else (1, 0 if len(block_norms) == 1 else 1)
    math_kernel = _math_kernel(cell, spec, device_type)
    query_width = latent.query if latent else heads * spec.head_dim
    value_width = latent.value if latent else query_width
    per_layer = activation_bytes_per_layer(
        spec.tokens_per_sample, cell.micro_batch, spec.hidden, heads, ffn=_ffn(spec, experts),
        mlp=_mlp_kind(cell, spec), value_bytes=value_bytes, dropout=False, fused_attention=fused, norm_bytes=norm,
        input_copies=(attention_in, 1 if experts else mlp_in), tensor_parallel=tensor_parallel_degree(cell),
        kv_heads=spec.kv_heads if fused and not masked else heads,
        experts_per_token=spec.required("top_k") if experts else 1,
        router_experts=spec.required("n_experts") if experts else 0,
        attention_width=query_width, value_width=value_width,
        mlp_value_bytes=residual_bytes if experts and autocast else None, norms=_norm_inputs(spec, block_norms),
        score_bytes=4.0 if math_kernel else _score_bytes(spec, value_bytes, autocast),
        sequence_parallel=cell.strategy.sequence_parallel, gathered_inputs_kept=True,
    )
    upcast = (4 - value_bytes) * spec.tokens_per_sample * cell.micro_batch * (2 * query_width + value_width)
    return (per_layer + (upcast if math_kernel else 0.0) + _qk_norms(cell, spec, value_bytes)
            + _fused_qkv_kept(cell, spec, value_bytes, query_width, fused, masked)
            + (_shared_expert(cell, spec, value_bytes, autocast) if experts else 0.0)
            + (_latent_attention(cell, spec, value_bytes, fused) if latent else 0.0)
            + _output_copy(cell, spec, value_bytes, fused, device_type)
            + (_kept_mask(cell, spec, value_bytes) if masked else 0.0))


def _norm_inputs(spec: ModelSpec, block_norms: tuple[NormKeeps, ...]) -> int:
    """How many inputs a block's norms keep: one each, but one for two where attention and
    MLP side by side read the same residual stream through a norm each (GPT-NeoX's
    ``use_parallel_residual``, Falcon's ``parallel_attn`` with a norm for each): the second
    norm keeps the first's input (its per-token statistics aside). The keys are read as the
    model reads them (``sources.config_value``)."""
    if spec.hf is None:
        return len(block_norms)
    config = hf_config.resolved(spec.hf)
    side_by_side = any(sources.config_value(config, key) for key in ("use_parallel_residual", "parallel_attn"))
    return 1 if side_by_side and len(block_norms) == 2 else len(block_norms)


def _ffn(spec: ModelSpec, experts: bool) -> int:
    """A block's MLP width: its experts' (spec.ffn), or a dense block's beside experts ones."""
    dense = models.param_layout(spec).dense_ffn
    return spec.ffn if experts or not dense else dense


def _fused_kernel(cell: CellSpec, spec: ModelSpec, device_type: str) -> bool:
    """Whether the cell's attention runs in a fused kernel (``attention_is_fused``), but for
    latent attention on the CPU: its query and key heads are wider than its value heads
    (DeepSeek-V3: 192 against 128), which the CPU's flash kernel does not take, so SDPA runs
    its math kernel there and keeps the scores (CUDA's memory-efficient kernel takes them)."""
    latent = models.param_layout(spec).latent_attention
    unequal_heads = latent is not None and latent.query != latent.value
    return attention_is_fused(cell) and not (device_type == "cpu" and unequal_heads)


def _math_kernel(cell: CellSpec, spec: ModelSpec, device_type: str) -> bool:
    """Whether SDPA falls back to the CPU's math kernel (``_fused_kernel``), which keeps its
    scores and its own copies of Q, K and V in fp32, whatever the model computes in."""
    return attention_is_fused(cell) and not _fused_kernel(cell, spec, device_type)


def _output_copy(cell: CellSpec, spec: ModelSpec, value_bytes: int, fused: bool, device_type: str) -> float:
    """The copy of a fused kernel's output that the output projection takes, where the CPU's
    kernel gives its output heads-first: where the query it gets is laid out heads-first, made
    by a concatenation (a partial rotary embedding's turned and unturned channels: GLM-4.5,
    StableLM; Phi-3's rotary embedding, which concatenates whatever share it turns,
    ``ParamLayout.rotary_concatenates``; latent attention's rotary and plain parts), transformers' transpose to
    tokens-first copies it, and both are kept. A query that is a projection's transposed view
    (LLaMA's) gives an output already tokens-first: no copy. Measured on the CPU only; on CUDA
    the fused kernels write their output tokens-first."""
    if not fused or device_type != "cpu" or spec.hf is None:
        return 0.0
    layout = models.param_layout(spec)
    latent = layout.latent_attention
    if latent is None and hf_config.rotary_fraction(spec.hf) == 1.0 and not layout.rotary_concatenates:
        return 0.0
    width = latent.value if latent else spec.required("n_heads") * spec.head_dim
    return value_bytes * spec.tokens_per_sample * cell.micro_batch * width / tensor_parallel_degree(cell)


def _kept_mask(cell: CellSpec, spec: ModelSpec, value_bytes: int) -> float:
    """The mask a block hands SDPA (``_masked_blocks``): torch's SDPA turns the boolean mask
    into an additive one in the query's dtype, a new s×s tensor per micro-batch sample in
    every attention call, which its kernel keeps for backward (measured on the CPU: Falcon's
    saved tensors)."""
    return float(value_bytes * cell.micro_batch * spec.tokens_per_sample ** 2)


def _latent_attention(cell: CellSpec, spec: ModelSpec, value_bytes: int, fused: bool) -> float:
    """What multi-head latent attention keeps beside the Q, K, V and output that every
    attention keeps (``activation_bytes_per_layer``): the query latent's RMSNorm and the
    q_b projection's input; the key-value latent's RMSNorm, which keeps its fp32 input (at
    fp32 the split view of the whole kv_a output, rotary key included) and its normalised
    value, and the kv_b projection's input. In a fused kernel V is a view of kv_b's output,
    which keeps the keys' part of it too (measured on the CPU: transformers'
    DeepseekV3Attention). TP divides none of it: no tensor-parallel plan takes latent
    attention."""
    latent = models.param_layout(spec).latent_attention
    assert latent is not None
    kv_rank = latent.kv_latent - latent.rope
    query = (4 + 2 * value_bytes) * latent.q_rank
    kv_input = 4 * (latent.kv_latent if value_bytes == 4 else kv_rank)
    kv = kv_input + 2 * value_bytes * kv_rank
    values_beside = value_bytes * (latent.kv_up - latent.value) if fused else 0.0
    return spec.tokens_per_sample * cell.micro_batch * (query + kv + values_beside)


def _shared_expert(cell: CellSpec, spec: ModelSpec, value_bytes: int, autocast: bool) -> float:
    """What a block's shared expert keeps beside its routed ones (``ParamLayout.
    shared_expert_width``: a SwiGLU MLP every token passes through): SwiGLU's four ffn-wide
    values, under autocast the 16-bit copies of its input its gate and up projections take,
    and where a sigmoid gate scales its output (Qwen2-MoE; not DeepSeek's or GLM's), that
    output for the gate's product."""
    layout = models.param_layout(spec)
    if not layout.shared_expert_width:
        return 0.0
    tokens = spec.tokens_per_sample * cell.micro_batch
    inputs = 2 * value_bytes * spec.hidden if autocast else 0
    gated = value_bytes * spec.hidden if layout.shared_expert_gated else 0
    return tokens * (4 * value_bytes * layout.shared_expert_width + gated + inputs) / tensor_parallel_degree(cell)


def _score_bytes(spec: ModelSpec, value_bytes: int, autocast: bool) -> float:
    """What eager attention keeps per score: the softmax's output, in fp32 where it computes
    in fp32 from 16-bit scores (``_softmax_upcast``) with the 16-bit copy the matmul with V
    saves beside it; and the tanh's output where the model soft-caps its scores (Gemma2)."""
    softmax = 4.0 + value_bytes if _softmax_upcast(spec, value_bytes, autocast) else float(value_bytes)
    return softmax + (value_bytes if _soft_capped(spec, "attn_logit_softcapping") else 0)


def _softmax_upcast(spec: ModelSpec, value_bytes: int, autocast: bool) -> bool:
    """Whether eager attention's softmax computes in fp32 from 16-bit scores: under autocast
    (softmax is on its fp32 list) and, where the engine casts the model itself, where the
    model asks for it (``ParamLayout.softmax_fp32``: traced, LLaMA eager at 2,048 tokens under
    FSDP2's bf16, 0.47 of its peak without it)."""
    return value_bytes < 4 and (autocast or models.param_layout(spec).softmax_fp32)


def _qk_norms(cell: CellSpec, spec: ModelSpec, value_bytes: int) -> float:
    """What a block's per-head query and key norms keep (Qwen3, Gemma3, OLMo2: an RMSNorm on
    the q and k projections' outputs, before eager attention expands K to every head; what it
    keeps per element measured, ``ParamLayout.qk_norm``), beside the Q and K the attention
    keeps; 0 for a model without them. Where a fused projection makes Q and K (Persimmon), the
    norms' inputs are views of its output, counted with it (``_fused_qkv_kept``)."""
    layout = models.param_layout(spec)
    if layout.qk_norm is None:
        return 0.0
    per_element = layout.qk_norm.at(value_bytes) - (value_bytes if layout.fused_qkv else 0)
    width = (spec.required("n_heads") + spec.kv_heads) * spec.head_dim
    return per_element * spec.tokens_per_sample * cell.micro_batch * width / tensor_parallel_degree(cell)


def _fused_qkv_kept(cell: CellSpec, spec: ModelSpec, value_bytes: int, query_width: int, fused: bool,
                    masked: bool) -> float:
    """What a fused QKV projection's output costs beyond the Q, K and V the attention keeps.
    Where a rotary embedding or a query-key norm turns Q and K into new tensors and V, a view
    of the projection's output, reaches a fused attention kernel as it is (grouped K and V go to
    SDPA as they are unless a mask makes transformers expand them: ``_masked_blocks``), V keeps
    the whole output alive, Q's and K's widths besides its own (GPT-NeoX, Phi-3; measured: their
    saved tensors). Eager attention's matmul keeps a contiguous copy of V instead, so nothing,
    unless query-key norms keep views of the output as their inputs: then all of it (Persimmon).
    Without either, Q and K are views of the same output (GPT-2's c_attn), which the three
    terms already count once."""
    layout = models.param_layout(spec)
    heads = spec.required("n_heads")
    key_width = query_width * spec.kv_heads // heads
    tokens = spec.tokens_per_sample * cell.micro_batch / tensor_parallel_degree(cell)
    if not layout.fused_qkv:
        return 0.0
    if not fused:
        return value_bytes * tokens * (query_width + 2 * key_width) if layout.qk_norm else 0.0
    turned = layout.rotary or layout.qk_norm is not None
    if not turned or (spec.kv_heads != heads and masked):
        return 0.0
    return value_bytes * tokens * (query_width + key_width)


def _block_kinds(cell: CellSpec, spec: ModelSpec) -> collections.Counter[tuple[bool, bool, bool, bool]]:
    """How many blocks are (checkpointed, computed in fp32, routed to experts, handed a mask),
    by the per-layer options and the model's blocks."""
    n_blocks = spec.n_layers
    checked, fp32 = (cell.strategy.blocks(option, n_blocks) for option in ("checkpoint_blocks", "fp32_blocks"))
    routed = models.param_layout(spec).expert_blocks or (spec.layout == "mixtral",) * n_blocks
    masked = _masked_blocks(cell, spec)
    return collections.Counter((i in checked, i in fp32 or cell.strategy.precision == "fp32", routed[i], masked[i])
                               for i in range(n_blocks))


def _masked_blocks(cell: CellSpec, spec: ModelSpec) -> tuple[bool, ...]:
    """Per block, whether SDPA gets its attention with a mask rather than the causal flag:
    every block of a model that makes its causal mask (``ParamLayout.explicit_mask``: Falcon),
    and a block masked to a sliding window the sequence reaches (transformers then cannot skip
    the mask: Mistral's, Phi-3's and Gemma3's sliding blocks; ``sources.attention_windows``).
    transformers then expands grouped K and V to every head for SDPA (repeat_kv), and SDPA
    keeps an additive copy of the mask (``_kept_mask``); flash attention takes the window as a
    number, eager adds the mask to scores it keeps anyway."""
    n_blocks = spec.n_layers
    # Megatron builds its own model; context parallel's ring attention takes no mask (both
    # refuse a window the sequence passes).
    own_model = strategies.get(cell.strategy.name).engine_model.analytic in ("megatron", "context_parallel")
    if cell.attention != "sdpa" or own_model:
        return (False,) * n_blocks
    if models.param_layout(spec).explicit_mask:
        return (True,) * n_blocks
    return tuple(window is not None and spec.tokens_per_sample >= window for window in sources.attention_windows(spec))


def as_block(cell: CellSpec, checkpointed: bool, fp32: bool) -> CellSpec:
    """The cell as one kind of its blocks sees it: checkpointed (as the cell's mode says) or
    not, in the cell's precision or in fp32 (``fp32_blocks``: autocast off, or FSDP2's fp32
    policy, inside the block), with no per-layer option left."""
    s = cell.strategy
    block = dataclasses.replace(s, checkpoint_every=None, checkpoint_blocks=None, fp32_blocks=None,
                                checkpointing=s.checkpointing if checkpointed else "none",
                                precision="fp32" if fp32 else s.precision,
                                loss_scaling="dynamic" if fp32 else s.loss_scaling)
    return dataclasses.replace(cell, strategy=block)


def _selective_per_layer(cell: CellSpec, spec: ModelSpec, value_bytes: int, residual_bytes: int,
                         experts: bool, device_type: str) -> float:
    """What one block keeps under the harness's selective recompute (features/
    checkpointing.py: every matmul's and attention kernel's output saved, the element-wise
    ops recomputed from them), not Korthikanti's selective (the attention core alone
    recomputed, formulas.activation_bytes_per_layer): the block's input, from the residual
    stream; each projection's output (q, k and v at their heads' widths, the output
    projection, and the MLP's: up and down, plus gate for SwiGLU, times top_k experts and
    the router's logits for a mixture of experts, whose routed experts keep nothing where a
    grouped matmul computes them, an op the policy recomputes); and the attention's output with, for a
    fused kernel, its fp32 log-sum-exp per row, for eager attention its score matmul's s×s
    output. A tensor-parallel cell divides the column-parallel projections and attention by
    its degree."""
    s, b, h, f = spec.tokens_per_sample, cell.micro_batch, spec.hidden, _ffn(spec, experts)
    heads = spec.required("n_heads")
    fused = _fused_kernel(cell, spec, device_type)
    layout = models.param_layout(spec)
    latent = layout.latent_attention
    if latent:  # q_a (where the queries have a latent), q_b or q, kv_a and kv_b's outputs
        attention_projections = float(latent.q_rank + latent.query + latent.kv_latent + latent.kv_up)
        out_width = latent.value
    else:  # h wide, but where a config sets its head width apart (Qwen3, Gemma)
        out_width = heads * spec.head_dim
        attention_projections = out_width * (1 + 2 * (spec.kv_heads or heads) / heads)
    mlp = (2 * f + h) if _mlp_kind(cell, spec).startswith("swiglu") else (f + h)
    if experts:  # the routed ones' outputs, unless a grouped matmul (not saved) made them
        shared = 2 * layout.shared_expert_width + h if layout.shared_expert_width else 0
        routed = 0 if layout.grouped_experts else spec.required("top_k") * mlp
        mlp = routed + spec.required("n_experts") + shared
    projections = value_bytes * s * b * (attention_projections + h + mlp)
    attention = value_bytes * s * b * out_width + (4.0 * heads * s * b if fused else value_bytes * heads * s * s * b)
    degree = tensor_parallel_degree(cell)
    # A row-parallel projection's output (the attention's output projection's, the MLP's down
    # projection's) is each rank's partial sum, h wide: not divided by the degree.
    row_parallel = value_bytes * s * b * 2 * h if degree > 1 else 0.0
    return residual_bytes * s * b * h / sequence_slices(cell) + (projections + attention - row_parallel) / degree \
        + row_parallel


def _logits_bytes(cell: CellSpec, spec: ModelSpec) -> float:
    """The logits the loss keeps: s·b·V (a classifier's b·classes; the MLP model's are too
    few to count), in fp32 where transformers' loss functions upcast them
    (``ParamLayout.loss_upcasts_logits``: its causal LMs) or autocast runs the cross-entropy in
    fp32; a loss that takes them as the model computed them (BERT's and RoBERTa's
    CrossEntropyLoss) keeps them 16-bit where the engine casts the model (FSDP's mixed
    precision, DeepSpeed)."""
    if spec.family == "mlp":
        return 0.0
    fp32 = (models.param_layout(spec).loss_upcasts_logits or cell.strategy.precision == "fp32"
            or uses_autocast(cell))
    value_bytes = 4.0 if fp32 else PRECISION_BYTES[cell.strategy.precision]
    if spec.task == "image_classification":
        return value_bytes * cell.micro_batch * spec.required("num_classes")
    vocabulary = spec.required("vocab_size") / vocabulary_slices(cell)
    return value_bytes * spec.tokens_per_sample * cell.micro_batch * vocabulary


def _kept_logits_bytes(cell: CellSpec, spec: ModelSpec) -> float:
    """The logits the forward keeps: the loss's, and as many again where the model soft-caps
    them with a tanh, which keeps its output (Gemma2)."""
    return (2 if _soft_capped(spec, "final_logit_softcapping") else 1) * _logits_bytes(cell, spec)


def _soft_capped(spec: ModelSpec, key: str) -> bool:
    """Whether a config soft-caps (cap · tanh(x / cap)) its attention scores or its logits."""
    return spec.hf is not None and bool(spec.hf.config.get(key))


def uses_autocast(cell: CellSpec) -> bool:
    """Whether a bf16 or fp16 cell computes under torch autocast: the engines that keep fp32
    parameters and do not cast the model themselves (not FSDP's mixed-precision policy, not
    DeepSpeed, whose fp32 master partition is the optimizer's)."""
    engine = _engine(cell)
    return cell.strategy.precision != "fp32" and "params" not in engine.sharded and not engine.fp32_master_partition


def _mlp_kind(cell: CellSpec, spec: ModelSpec) -> str:
    """How the model's MLP keeps its activations (formulas.activation_bytes_per_layer's
    ``mlp``), read from the built block: a gated MLP (LLaMA's SwiGLU, Gemma's GeGLU, Phi-3's
    fused gate and up projection) keeps what SwiGLU does, else its activation module decides
    (a ReLU keeps its output alone: OPT's).
    Selective checkpointing saves the matmul outputs and recomputes the pointwise ops between
    them (features/checkpointing.py), so an unfused GeLU keeps only what a fused one does.
    gpt-oss's experts clamp their gate and up projections before the GLU (its config's
    ``swiglu_limit``), which keeps more."""
    if spec.hf is not None and getattr(hf_config.resolved(spec.hf), "swiglu_limit", None):
        return "swiglu_clamped"
    if spec.layout in ("llama", "mixtral") or models.param_layout(spec).gated_mlp:
        return "swiglu"
    activation = models.param_layout(spec).mlp_activation
    if activation == "ReLU":
        return "relu"
    unfused = activation == "NewGELUActivation"
    return "gelu_tanh_unfused" if unfused and cell.strategy.checkpointing != "selective" else "gelu"


def loss_bytes(cell: CellSpec, spec: ModelSpec) -> float:
    """What the loss's backward holds at the start of backward: the gradients of the
    log-probabilities and of the logits, two logits-sized tensors (``_logits_bytes``:
    transformers upcasts a causal LM's logits to fp32 and cross_entropy's log_softmax keeps
    its output, the activations' ``logits`` term); torch's vocabulary-parallel loss
    (``loss_parallel``) a third slice of them (llama-tiny, 2 gloo ranks: 65,536 B, one slice,
    over two at backward's start)."""
    return (3.0 if cell.strategy.loss_parallel else 2.0) * _logits_bytes(cell, spec)


def optimizer_step_bytes(cell: CellSpec, layout: ParamLayout, device_type: str) -> float:
    """The optimizer step's own temporaries, beside every state: torch's AdamW computes the
    denominator sqrt(v̂) + ε out of place, over the whole parameter list at once where it
    takes its multi-tensor path (torch's default for CUDA tensors: one fp32 copy of the
    rank's parameters), one tensor at a time on the CPU (the sqrt and the quotient of the
    largest tensor). DeepSpeed hands the optimizer one flat partition, its largest tensor
    (ZeRO-3 one sub-group of it at a time: Moonlight-16B's step traced at 37.2 GiB a rank,
    where the whole partition's temporaries would make it 44.6);
    under bf16 or fp16 that partition's gradient is an fp32 copy of the 16-bit gradient
    partition, made for the step (an fp32 model's optimizer reads the partition itself under
    ZeRO-1/2; ZeRO-3 flattens a sub-group's gradients into a new tensor in fp32 too).
    bitsandbytes' 8-bit kernels and Adafactor's factored update keep none worth counting."""
    if cell.strategy.optimizer != "adamw":
        return 0.0
    engine = _engine(cell)
    degree = shard_degree(cell) if "optimizer" in engine.sharded else 1
    stepped = (deepspeed_zero.largest_sub_group(layout.shapes, degree) if engine.steps_in_sub_groups
               else layout.numel / degree)
    low_precision_master = engine.fp32_master_partition and cell.strategy.precision != "fp32"
    # ZeRO-3 flattens each sub-group's gradients into a new fp32 tensor for its step in any
    # precision (llama-100m at 256 tokens, checkpointed, fp32: 0.944 of the trace without it).
    master_grad = 4.0 * stepped if low_precision_master or engine.steps_in_sub_groups else 0.0
    if device_type == "cuda":
        return 4.0 * stepped + master_grad
    if engine.fp32_master_partition:
        return 2 * 4.0 * stepped + master_grad
    largest = max(math.prod(shape) for shape in layout.shapes)
    return 2 * 4.0 * largest / (shard_degree(cell) if "params" in engine.sharded else 1)


def comm_bytes_per_step(cell: CellSpec, layout: ParamLayout, nodes: int = 1) -> dict[str, float]:
    """Payload bytes per collective kind per optimizer step, in the harness's convention
    (harness/measure/comm.py: all-reduce the tensor, all-gather the gathered output,
    reduce-scatter the full input), so it compares with the counted bytes directly.

    From ZeRO §7 and the FSDP paper §3.2, per engine: DDP all-reduces the gradients once per
    step (fp32, or half with an fp16 hook; PowerSGD the factors of ``powersgd_elements``;
    int8 quantization an all-gather of uint8 buckets with their scales, top-k an all-gather
    and random-k an all-reduce of 1 % of the entries: formulas/compression.py, one bucket;
    local SGD the parameters' fp32 all-reduce of its averaging steps, which is the counted
    step and as large as DDP's, sent every local_sgd_period-th step and nothing between);
    ZeRO-1 over DDP adds a broadcast of the updated parameters (torch and FairScale OSS);
    FairScale SDP reduces to each owner and broadcasts; FSDP all-gathers the parameters
    (in the compute dtype) in forward and, resharded, again in backward, and
    reduce-scatters fp32 gradients; with accumulation the gathers repeat per micro-step
    while the reduction happens once; FSDP1 keeps the root unit gathered between forward and
    backward; HSDP also all-reduces each shard over the replicate dimension; DeepSpeed
    ZeRO-1/2 all-reduces the gradients (ZeRO-1 once per step, ZeRO-2 each micro-step) and
    all-gathers the updated partitions, ZeRO-3
    gathers in forward and, in backward, again what it released beyond its live-parameter
    budget (``ds_live_numel``), and reduce-scatters, each micro-step;
    its persistent parameters are gathered once per step instead, after the update.
    Scalars (loss-scale and overflow flags) are left out.
    """
    s, engine = cell.strategy, _engine(cell)
    psi, a = layout.numel, s.accumulation
    low = PRECISION_BYTES[s.precision]
    if engine.comm == "all_reduce":
        n = s.data_parallel_size(cell.world_size)
        out: dict[str, float] = {}
        if s.compression == "powersgd":
            out["all_reduce"] = 4 * sum(powersgd_elements(shape, s.powersgd_rank) for shape in layout.shapes)
        elif s.compression in ("int8_tensor", "int8_channel"):
            channel = compression.INT8_CHANNEL if s.compression == "int8_channel" else None
            out["all_gather"] = int8_allgather_bytes(psi, n, channel)
        elif s.compression == "topk":
            out["all_gather"] = sparsified_bytes(psi, n, sparsification.DENSITY, "topk")
        elif s.compression == "randomk":
            out["all_reduce"] = sparsified_bytes(psi, n, sparsification.DENSITY, "randomk")
        else:
            out["all_reduce"] = psi * (2 if s.compression in ("fp16", "bf16") else 4)
        if "optimizer" in engine.sharded:  # each rank broadcasts the parameters it updated
            out["broadcast"] = 4 * psi
        return out
    if engine.comm == "reduce_to_owner":
        return {"reduce": 4 * psi, "broadcast": 4 * psi}
    if engine.comm == "gather_and_reduce_scatter":
        gather = low * psi + _fp32_block_extra(cell, layout)
        gathers = {"forward": gather, "forward_and_backward": 2 * gather,
                   "forward_and_backward_but_root": 2 * gather - low * layout.root_numel}[engine.gathers]
        out = {"all_gather": gathers * a, "reduce_scatter": 4 * psi}
        if engine.shard_group == "hsdp_shard":
            out["all_reduce"] = 4 * psi / shard_degree(cell, nodes)
        return out
    if engine.comm == "deepspeed":
        if "params" not in engine.sharded:  # ZeRO-1/2
            # ZeRO-2 reduces each gradient as backward produces it, so every micro-step
            # (DeepSpeed's engine: "ZeRO stage >= 2 communicates during non gradient
            # accumulation boundaries as well"); ZeRO-1 once, at the boundary.
            reductions = a if engine.grad_partition_in_backward else 1
            return {"all_reduce": low * psi * reductions, "all_gather": low * psi}
        persistent = persistent_numel(cell, layout)
        regathered = psi - persistent - ds_live_numel(cell, layout)  # in backward, those released in forward
        return {"all_gather": low * ((psi - persistent + regathered) * a + persistent),
                "reduce_scatter": low * psi * a}
    return {}  # the reference: nothing to communicate


def offloaded_bytes(cell: CellSpec, states: dict[str, float], layout: ParamLayout) -> dict[str, float]:
    """Which model states live in host memory rather than on the device (ZeRO-Offload,
    Ren et al. 2021; FSDP CPUOffload): parameter offload moves the sharded parameters and
    gradients (FSDP also the optimizer state, made on the host where its parameters are),
    optimizer offload the gradients' fp32 copy, master weights and moments; ``offload_blocks``
    the listed blocks' share of parameters, gradients and optimizer state.
    DeepSpeed keeps its persistent parameters on the device, whole and partitioned."""
    s = cell.strategy
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    if s.offload in ("params", "optimizer_params"):
        persistent = persistent_numel(cell, layout)
        kept = persistent * (1 + 1 / shard_degree(cell)) * PRECISION_BYTES[s.precision]
        out["params"] = states["params"] - kept
        # FSDP's CPU offload keeps the sharded gradients on the host too, and the optimizer
        # steps there, making its state beside them; DeepSpeed's offload_param moves the
        # parameters only.
        if strategies.get(s.name).engine != "deepspeed":
            out["grads"], out["optimizer"] = states["grads"], states["optimizer"]
    if s.offload in ("optimizer", "optimizer_params"):
        out["optimizer"] = states["optimizer"]
        out["grads"] = states["grads"]
    if s.offload_blocks:  # FSDP2's per-module offload: those blocks' share of every state
        share = len(s.blocks("offload_blocks", cell.model_spec.n_layers)) * layout.block_numel / layout.numel
        out = {kind: share * states[kind] for kind in out}
    return out


def ds_live_numel(cell: CellSpec, layout: ParamLayout) -> int:
    """The parameters DeepSpeed ZeRO-3 holds gathered from forward into backward, by its
    coordinator's fetch, prefetch and release rules replayed over the model's modules
    (predict/zero3_residency.py): every parameter but the persistent ones (which the model
    states count whole) on the tiny models, whose whole step is within the reuse distance;
    none after a forward pass without backward before the first training step (a cell that
    ``evaluates_first``): from then on the coordinator releases every parameter but the
    persistent ones after its forward use and gathers it again in backward, every step
    (measured on gpt2-bytes, 2 ranks: 69 all-gathers and 3,780,864 B a step against 51 and
    1,900,800 B without the held-out loss at step 0; an evaluation after training steps
    leaves the next step gathering less, the ones after it as before:
    tests/test_deepspeed.py).

    Beside those, the parameters a block's forward saves a view of (ParamLayout.saved_as_views:
    transformers' grouped experts) stay in memory after the coordinator releases them, in
    every block that keeps its activations (a checkpointed block saves its input only, an
    offloaded one copies what it saves to the host): on Moonlight (DeepSeek-V3, 64 experts
    of 1408 a layer, 26 such layers) 25 layers' experts, 26 GiB of bf16 a GPU that the
    coordinator counts as released (traced; and measured on 2 gloo ranks: the released
    weights' storages held by GroupedMmBackward0's saved views)."""
    held = _held(cell, layout)
    if cell.evaluates_first:
        return sum(math.prod(layout.shapes[p]) for p in held)
    return _residency(cell, layout, held).end_of_forward


def ds_gathered_numel(cell: CellSpec, layout: ParamLayout) -> tuple[int, int]:
    """(``ds_live_numel``, the most DeepSpeed ZeRO-3 holds gathered while the last block's
    backward runs), counted alike, from one replay of the coordinator carried into backward
    (zero3_residency.Gathered.last_block_backward), where, once the head's backward has
    put its count under the live budget, its prefetch passes every parameter forward kept
    and gathers the rest, the tied token table whole, beyond the budget (llama-1b on 8 ranks,
    checkpointed: 1.18 of its 1.24B parameters, against 1.00B when forward ends; traced:
    1.22B, the coordinator's modules without parameters prefetching too). Both
    ``ds_live_numel`` where the coordinator has no trace to prefetch by (``evaluates_first``)."""
    if cell.evaluates_first:
        live = ds_live_numel(cell, layout)
        return live, live
    gathered = _residency(cell, layout, _held(cell, layout))
    return gathered.end_of_forward, max(gathered.end_of_forward, gathered.last_block_backward)


def _held(cell: CellSpec, layout: ParamLayout) -> frozenset[int]:
    """``ds_live_numel``'s ``held``: the parameters saved as views in the blocks that keep their activations."""
    checkpointed = cell.strategy.blocks("checkpoint_blocks", cell.model_spec.n_layers)
    return frozenset(p for block, params in layout.modules if block >= 0 and block not in checkpointed
                     for p in params if p in layout.saved_as_views)


def _residency(cell: CellSpec, layout: ParamLayout, held: frozenset[int]) -> zero3_residency.Gathered:
    """The coordinator's replay at the cell's settings."""
    sizes = _ds_sizes(cell)
    return zero3_residency.replay(
        layout, persistence_threshold=sizes["stage3_param_persistence_threshold"],
        prefetch_bucket_size=sizes["stage3_prefetch_bucket_size"],
        max_live_parameters=sizes["stage3_max_live_parameters"], max_reuse_distance=sizes["stage3_max_reuse_distance"],
        recompute=cell.strategy.checkpointing in ("full", "selective"), held=held)


def transient_bytes(cell: CellSpec, layout: ParamLayout, spec: ModelSpec,
                    device_type: str = "cuda") -> dict[str, float]:
    """Tensors that exist only during forward and backward, beside the model states:

    - ``gathered``: sharded parameters gathered for compute as backward starts (FSDP,
      ZeRO-3), in the compute dtype: the root unit (embeddings and head, gathered for the whole
      step) and the last block, gathered for its backward while the head's runs (traced,
      Moonlight's 4-layer cut under FSDP2: one block's all-gather buffer beside the root's at
      the peak; the blocks prefetch further ones from their own backward hooks); FSDP's
      grad_op (SHARD_GRAD_OP) keeps every unit gathered from forward to the end of backward,
      and DeepSpeed ZeRO-3 what its live-parameter budget lets it keep (``ds_live_numel``);
    - ``prefetched``: the blocks gathered beside the one whose backward runs (FSDP's
      prefetch: the next one, or ``prefetch`` N), counted at the last block's backward;
      DeepSpeed ZeRO-3's, what its prefetch has gathered by then beyond ``gathered``
      (``ds_gathered_numel``);
    - ``autocast_copies``: torch autocast caches a 16-bit copy of every matmul weight it
      casts for the rest of the forward (DDP, ZeRO-1 and the reference under bf16/fp16);
    - ``recompute``: with checkpointing, what one block's backward makes again
      (``recompute_bytes``), held while that block's backward runs, after the head's;
    - ``loss``: the loss's gradients at the start of backward (``loss_bytes``);
    - ``activation_grads``: the gradients a block's backward holds for its activations: for a
      transformer a few s·b·h, small beside the ~34 s·b·h its block keeps, and left out; for
      the convnet two maps as large as each kept one (the gradients of the ReLU's and of the
      convolution's outputs), a third of what a block keeps;
    - ``score_grads``: where attention makes its s×s scores (eager, or the CPU's math kernel),
      the gradients of the softmax's output and of its input, both held as the last block's
      softmax runs its backward, less the 16-bit copy of the softmax's output that the V
      matmul's backward has freed by then (``_score_grads``): at long sequences this, not the
      start of backward, is the peak;
    - ``root_reduce``: FSDP reduce-scatters the root unit's gradients last in backward, in
      fp32: the unsharded gradients (FSDP2 frees them once copied in), the flat fp32 input
      they are copied into, the fp32 shard the reduction lands in and, on gloo, the copy of
      the input that gloo all-reduces instead (harness/predict/traced.py): 8 + 4/N bytes an
      element on the CPU under FSDP2, the compute dtype's more under FSDP1; on CUDA the
      gradients and the input (as FSDP2's foreach_reduce reads; not yet measured on a GPU).
      Where the head is tied to the token table, the moment before it, the table's gradient
      summed in the root's backward, is larger (analytic.peak_breakdown);
    - ``block_reduce``: the last block's gradients, reduce-scattered as its backward ends
      while every earlier block's activations are still held: three fp32 copies on the CPU,
      two on CUDA; the peak where blocks are large beside the root and the logits (vit-tiny
      under FSDP2);
    - ``buffers_after_backward``: buffer bytes counted at the optimizer step but not at the
      start of backward: under top-k and random-k the hook's averaged result, made at the end
      of backward and held by DDP's reducer through the step (its working copy, the
      error-corrected gradient, replaces the previous error as it is made, so nothing more is
      held at the hook than at the step); on the CPU with several DDP buckets (bucket_cap_mb
      below the gradients' bytes) and a comm hook, the buckets, which the CPU trackers see
      only as each is filled (without a hook they are counted from the step's start:
      measure/memory.py, all_reduced_buffers).
    - FSDP2 with ``prefetch`` N gathers up to N + 1 blocks at once (the one computing and the
      N prefetched; no more than the model has) beside the root unit.
    """
    s, engine = cell.strategy, _engine(cell)
    low = PRECISION_BYTES[s.precision]
    n_fp32 = len(s.blocks("fp32_blocks", spec.n_layers))

    def blocks_bytes(n: int) -> float:
        """n blocks gathered, taken to be the widest: fp32 ones first."""
        return low * n * layout.block_numel + (4 - low) * min(n, n_fp32) * layout.block_numel

    params_sharded = "params" in engine.sharded
    gathered = low * layout.root_numel + blocks_bytes(1) if params_sharded else 0.0
    prefetched = (blocks_bytes(min(1 + (s.prefetch or 1), spec.n_layers)) - blocks_bytes(1)
                  if params_sharded else 0.0)
    if engine.keeps_gathered == "always":  # gathered in forward, kept through backward
        gathered = low * (layout.numel - persistent_numel(cell, layout)) + _fp32_block_extra(cell, layout)
        prefetched = 0.0
    elif engine.keeps_gathered == "within_live_parameters":
        # What its prefetch gathers beyond that by the last block's backward (ds_gathered_numel).
        live, most = ds_gathered_numel(cell, layout)
        gathered, prefetched = low * live, low * (most - live)
    reduces_root_last = engine.comm == "gather_and_reduce_scatter" and params_sharded
    # Bytes a root element holds as it is reduce-scattered (root_reduce): its unsharded
    # gradient in the compute dtype, the fp32 reduce input it is copied into, the fp32 shard
    # the reduction lands in and, on gloo, the copy gloo all-reduces; FSDP2 frees the
    # gradients once copied in, before the shard and gloo's copy are made (gpt2-124m on 8
    # ranks, traced: FSDP2 8.5 bytes an element in fp32 and bf16, FSDP1 10.5 in bf16). A
    # block's reduce, amid backward, holds three fp32 copies on the CPU (vit-tiny under FSDP2,
    # measured), two on CUDA.
    reduce_copy = 4.0 if device_type == "cpu" else 0.0
    landed = 4.0 + 4.0 / shard_degree(cell) + reduce_copy
    per_root = low + landed if engine.reduce_holds_unsharded_grads else max(low + 4.0, landed)
    per_block = 3 * 4.0 if device_type == "cpu" else 2 * 4.0
    fp32_matmuls = n_fp32 * layout.block_matmul_numel  # not cast
    return {"gathered": gathered, "prefetched": prefetched,
            "autocast_copies": 2.0 * (layout.matmul_numel - fp32_matmuls) if uses_autocast(cell) else 0.0,
            "recompute": recompute_bytes(cell, spec, device_type), "loss": loss_bytes(cell, spec),
            "activation_grads": activation_bytes(cell, spec)["per_layer"] if spec.family == "convnet" else 0.0,
            "score_grads": _score_grads(cell, spec, device_type),
            "head_grad": _head_grad(cell, spec),
            "root_reduce": per_root * layout.root_numel if reduces_root_last else 0.0,
            "block_reduce": per_block * layout.block_numel if reduces_root_last else 0.0,
            "buffers_after_backward": _buffers_after_backward(cell, layout, device_type)}


def _head_grad(cell: CellSpec, spec: ModelSpec) -> float:
    """``transient_bytes``'s ``head_grad``: what a language model's head's backward holds
    beyond the activations: the logits' gradient, cast to the compute precision (the loss's
    other gradients and the logits freed by then), and the head's weight gradient (V×h) in
    the dtype its parameters compute in: the compute precision where the engine holds them
    so (DeepSpeed, FSDP's gathered units), else fp32. Most of what a rank whose parameters
    are all gathered holds at a short sequence (DeepSpeed ZeRO-3 within its live budget:
    gpt2-124m on 8 ranks at 128 tokens, checkpointed: 0.898 of the trace in fp32 without it)."""
    if spec.task not in ("causal_lm", "masked_lm"):
        return 0.0
    engine = _engine(cell)
    low = PRECISION_BYTES[cell.strategy.precision]
    weight_bytes = low if engine.fp32_master_partition or engine.comm == "gather_and_reduce_scatter" else 4.0
    vocab = spec.required("vocab_size") / tensor_parallel_degree(cell)
    return weight_bytes * vocab * spec.hidden + low * cell.micro_batch * spec.tokens_per_sample * vocab


def _score_grads(cell: CellSpec, spec: ModelSpec, device_type: str) -> float:
    """``transient_bytes``'s ``score_grads``, per score (b·heads·s² of them): two gradients of
    4 bytes where the softmax computes in fp32 (``_softmax_upcast``, the CPU's math kernel),
    else of the precision's, less the 16-bit copy of an upcast softmax's output, freed (traced: LLaMA,
    GPT-2 and Bloom eager at 2,048 tokens, 0.55-0.74 of their traced peaks without them). 0
    where a fused kernel makes no scores."""
    if spec.family in ("mlp", "convnet") or _fused_kernel(cell, spec, device_type):
        return 0.0
    math_kernel = _math_kernel(cell, spec, device_type)
    value_bytes = PRECISION_BYTES[cell.strategy.precision]
    upcast = not math_kernel and _softmax_upcast(spec, value_bytes, uses_autocast(cell))
    per_score = 2 * (4.0 if math_kernel or upcast else value_bytes) - (value_bytes if upcast else 0)
    scores = cell.micro_batch * spec.required("n_heads") * spec.tokens_per_sample ** 2
    return per_score * scores / tensor_parallel_degree(cell)


def _fp32_block_extra(cell: CellSpec, layout: ParamLayout) -> float:
    """What gathering the ``fp32_blocks`` in fp32 adds to gathering them in the cell's precision."""
    fp32 = cell.strategy.blocks("fp32_blocks", cell.model_spec.n_layers)
    return (4 - PRECISION_BYTES[cell.strategy.precision]) * len(fp32) * layout.block_numel


def _buffers_after_backward(cell: CellSpec, layout: ParamLayout, device_type: str) -> float:
    """``transient_bytes``'s ``buffers_after_backward``."""
    s, grads = cell.strategy, 4.0 * layout.numel
    result = grads if s.compression in SPARSIFIED else 0.0
    unseen_buckets = (device_type == "cpu" and _engine(cell).grad_buffer == "ddp_bucket"
                      and not s.gradient_as_bucket_view and not ddp.all_reduces_buckets(cell)
                      and s.bucket_cap_mb is not None and s.bucket_cap_mb * 2**20 < grads)
    return result + (grads if unseen_buckets else 0.0)


def recompute_bytes(cell: CellSpec, spec: ModelSpec, device_type: str = "cuda") -> float:
    """With checkpointing, what one block's backward makes again beside what the block
    kept: all of its activations (full), or all but the matmuls' and attention's outputs
    (selective)."""
    checked = [kind[:2] for kind in _block_kinds(cell, spec) if kind[0]]
    return max((activation_bytes(as_block(cell, False, fp32), spec, device_type)["per_layer"]
                - activation_bytes(as_block(cell, True, fp32), spec, device_type)["per_layer"] for _, fp32 in checked),
               default=0.0)
