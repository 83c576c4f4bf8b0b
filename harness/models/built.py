"""build(spec) -> BuiltModel: a seeded module plus what the harness needs to train and measure it."""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from . import bert, convnet, factory, gpt2, hf_config, layouts, llama, mlp, moe, vit
from .common import on_meta
from .spec import ModelSpec

# Each family file provides build_module, make_batch, loss and count_params; the repeated
# block is found in the built model (harness.models.layouts).
# A family may also provide flops_per_sample (where the PaLM formula below does not describe
# it: a convolution uses each weight at every position) and loss_and_correct (a classifier's
# held-out accuracy).
_FAMILIES: dict[str, ModuleType] = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit, "mlp": mlp,
                                    "convnet": convnet, "moe": moe, "hf_config": hf_config, "factory": factory}


def analytic_n_params(spec: ModelSpec) -> int:
    """All parameters (a tied weight once), from the spec alone: no model is built."""
    return _FAMILIES[spec.family].count_params(spec).total


def flops_per_sample(spec: ModelSpec) -> float:
    """Training FLOPs (forward + backward) per sample by the PaLM formula (Chowdhery et al. 2022).

    Per token 6*N + 12*L*H*Q*T, times T tokens per sample, where N counts the parameters that
    take part in a matmul: the token, position (and BERT's segment) table lookups and ViT's
    class token are left out, while the LM head (gpt2, llama, BERT's MLM decoder) is always in,
    V*h, whether or not its weight is tied to the token table: it is a V x h matmul in every
    forward either way, so a tied and an untied model of the same sizes have the same FLOPs.
    For moe, N counts the ACTIVE parameters, those a token passes through: attention, norms,
    the router (h x n_experts) and top_k of the n_experts experts per layer, so
    N = total - lookups - n_layers * (n_experts - top_k) * 3*h*ffn (Mixtral-8x7B: 12.9B of
    46.7B); a config's mixture of experts the same, counted on its built model (a shared
    expert and a dense block whole: common.count_module). It is what the hardware computes
    when every token goes to exactly top_k experts, as in Mixtral (no capacity limit, no
    dropped tokens); the routing itself (softmax, top-k, gather/scatter of tokens) is not a
    matmul and is left out.
    The causal mask is NOT credited with halving the attention term, as in torchtitan. For mlp
    (no attention, one "token" per sample) this is 6*N; convnet has its own count.
    """
    if hasattr(_FAMILIES[spec.family], "flops_per_sample"):
        own: float = _FAMILIES[spec.family].flops_per_sample(spec)
        return own
    count = _FAMILIES[spec.family].count_params(spec)
    n, t = count.matmul, spec.tokens_per_sample
    attention = 12 * spec.n_layers * (spec.n_heads or 0) * spec.head_dim * t
    return float((6 * n + attention) * t)


@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """The parameter tensors of a model, read from a build on the meta device (no memory,
    milliseconds even for 8B parameters), for the predictors."""

    shapes: tuple[tuple[int, ...], ...]  # every parameter, a tied weight once
    root_numel: int  # outside the repeated blocks: FSDP's root unit (embeddings, final norm, head)
    block_numel: int  # one repeated block: the unit FSDP and ZeRO-3 gather at a time
    # The weights and biases of the matmul layers (nn.Linear, transformers' Conv1D, a head
    # tied to the token table): what torch autocast casts to 16 bits, and caches for the rest
    # of the forward. Embedding tables and norms are not cast.
    matmul_numel: int = 0
    block_matmul_numel: int = 0  # those of one repeated block
    # The repeated block's MLP activation module, by class name (e.g. "NewGELUActivation",
    # "SiLUActivation"): how many tensors it keeps for backward depends on how it is written.
    mlp_activation: str = ""
    # What the repeated block's per-head query and key norm keeps (a ``q_norm`` module: Qwen3,
    # Gemma3, OLMo2), beside their projections' outputs; None for an attention without one.
    qk_norm: NormKeeps | None = None
    # Whether those are one query and one key norm, each of one head's channels (Qwen3's,
    # Gemma3's q_norm and k_norm), which tensor parallelism splits with the heads; not a
    # norm across every head (OLMo2's) nor a norm module a head (StableLM's).
    qk_norms_per_head: bool = False
    # Whether one projection outputs the repeated block's queries, keys and values together
    # (GPT-NeoX's query_key_value, Phi-3's qkv_proj, GPT-2's c_attn), which they are views of,
    # and whether the model turns its queries and keys by a rotary embedding (a module whose
    # class name says Rotary), which makes new tensors of them.
    fused_qkv: bool = False
    rotary: bool = False
    # Whether the model's loss goes through transformers' loss functions (its forward calls
    # ``self.loss_function``: its causal LMs, ModernBERT), which upcast the logits to fp32,
    # rather than a CrossEntropyLoss on the logits as computed (BERT's, RoBERTa's).
    loss_upcasts_logits: bool = False
    # The repeated block's other norms, in order, each with what it keeps for backward
    # (``NormKeeps``): two for GPT-2 and LLaMA, four for Gemma2 and Gemma3 (a norm before and
    # after each sublayer), one for Cohere (attention and MLP side by side, reading the same norm).
    block_norms: tuple[NormKeeps, ...] = ()
    # Those norms' module paths in the block, in the same order (``_norm_paths``): what
    # sequence parallelism must split, every one of them (strategies/tensor_parallel.py).
    block_norm_paths: tuple[str, ...] = ()
    # The elements of each parameter of those norms (one block's) and of the norms outside the
    # blocks (the final norm): what sequence parallelism leaves replicated, each gradient
    # all-reduced (none for a norm without weights: OLMo's).
    block_norm_param_numels: tuple[int, ...] = ()
    root_norm_param_numels: tuple[int, ...] = ()
    # Whether the block's MLP is gated, a gate projection beside the up projection (SwiGLU,
    # GeGLU), separate (LLaMA's gate_proj) or fused (Phi-3's gate_up_proj).
    gated_mlp: bool = False
    # Per repeated block, whether its MLP routes tokens to experts (a module named ``experts``):
    # every block of Mixtral and Qwen3-MoE, all but the first few of DeepSeek-V3 and GLM-4.5
    # (first_k_dense_replace), whose first blocks have a dense MLP ``dense_ffn`` wide.
    expert_blocks: tuple[bool, ...] = ()
    dense_ffn: int = 0
    # A mixture of experts' shared expert, the MLP every token passes through beside its routed
    # ones: its width (DeepSeek's n_shared_experts × moe_intermediate_size, Qwen2-MoE's
    # shared_expert_intermediate_size; 0 without one), and whether a sigmoid gate scales its
    # output (Qwen2-MoE's shared_expert_gate).
    shared_expert_width: int = 0
    shared_expert_gated: bool = False
    # The linear layers reading the attention's and a dense MLP's input, each of which takes its
    # own 16-bit copy of it under autocast: LLaMA's q, k, v and gate, up projections (3, 2),
    # BERT's query, key, value (3, 1), latent attention's two (q_a or q, and kv_a),
    # one where a projection is fused (Phi-3's qkv_proj and gate_up_proj, GPT-2's c_attn).
    input_linears: tuple[int, int] = (1, 1)
    # Multi-head latent attention (DeepSeek-V2/V3), or None.
    latent_attention: LatentAttention | None = None
    # Every module with parameters of its own, in registration order (the order a decoder's
    # forward runs them, up to a block's norms): its block's index (-1 outside the blocks) and
    # its parameters' indices into ``shapes`` (a tied weight is one index, in both modules):
    # what DeepSpeed ZeRO-3 fetches module by module (predict/zero3_residency.py).
    modules: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # The parameters (indices into ``shapes``) whose forward saves a view of them for backward:
    # the experts' 3-D weights of transformers' grouped_mm implementation, transposed for the
    # grouped matmul unless stored transposed already (gpt-oss). A view keeps the storage the
    # parameter was gathered into alive after DeepSpeed ZeRO-3 releases it (``param.data =``
    # an empty tensor swaps the parameter's storage, and frees the old one only once nothing
    # else holds it), until that block's backward.
    saved_as_views: frozenset[int] = frozenset()
    # Whether the experts run as one grouped matmul (transformers' grouped_mm, which the
    # harness's builds and config.json models take), an op the selective policy recomputes.
    grouped_experts: bool = False
    # Whether the model hands its attention a causal mask it has made even where the causal
    # flag alone would do (Falcon's create_causal_mask(allow_is_causal_skip=False), to add
    # ALiBi onto): transformers' SDPA then expands grouped keys and values to every head
    # (repeat_kv) rather than letting the kernel read them grouped.
    explicit_mask: bool = False
    # Whether the model's eager attention computes its softmax in fp32 whatever its scores'
    # dtype (transformers' eager_attention_forward of LLaMA and most decoders:
    # softmax(..., dtype=torch.float32).to(query.dtype)); GPT-2's and BERT's take the scores'.
    softmax_fp32: bool = False
    # Whether the model's rotary embedding concatenates what it turns with what it does not
    # (Phi-3's apply_rotary_pos_emb, whatever share it turns), making the query a new
    # heads-first tensor, as a partial rotary embedding written in the attention does.
    rotary_concatenates: bool = False

    @property
    def numel(self) -> int:
        return sum(_numel(s) for s in self.shapes)


@dataclass(frozen=True)
class NormKeeps:
    """The bytes a norm keeps for backward per element of its input, from an fp32 input and
    from a 16-bit one, its per-token statistics included: measured (``_norm_keeps``), since how
    a norm is written decides it. torch's LayerNorm keeps its input (4 and 2); transformers'
    RMSNorms an fp32 copy and the normalised value the weight multiplies (LLaMA's 8 and 6,
    Gemma's, which multiplies in fp32, 8 and 8); OLMo's weightless LayerNorm its fp32 upcast
    (4 and 4); Cohere's, written in torch ops, three fp32 values (12 and 12)."""

    fp32: float
    half: float

    def at(self, input_bytes: int) -> float:
        """Bytes per element from an input of ``input_bytes`` a value."""
        return self.fp32 if input_bytes == 4 else self.half


@dataclass(frozen=True)
class LatentAttention:
    """The widths, per token, of what multi-head latent attention's projections output
    (DeepSeek-V2, Liu et al. 2024): queries through a low-rank latent (``q_rank``; 0 where the
    config projects them directly), keys and values through one (``kv_latent``: the kv_lora_rank
    latent, which an RMSNorm normalises, with the shared rotary key beside it, ``rope`` wide),
    expanded to every head (``kv_up``: heads × (key width without rope + value width)); Q and K
    are ``query`` wide (heads × (no-rope + rope width)), V and the output ``value`` wide."""

    q_rank: int
    kv_latent: int
    rope: int
    kv_up: int
    query: int
    value: int


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@functools.cache
def param_layout(spec: ModelSpec) -> ParamLayout:
    with on_meta():
        module = _FAMILIES[spec.family].build_module(spec)
    blocks = list(layouts.repeated_blocks(module))
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    in_block_modules = {id(m) for b in blocks for m in b.modules()}
    params = list(module.parameters())  # de-duplicates tied weights
    matmul = {id(p): p.numel() for m in module.modules() if _is_matmul(m) for p in m.parameters(recurse=False)}
    expert_blocks, dense_ffn, shared_width, shared_gated = _mlp_kinds(blocks)
    block_modules = {name.rpartition(".")[2] for name, _ in blocks[0].named_modules()} if blocks else set()
    return ParamLayout(
        shapes=tuple(tuple(p.shape) for p in params),
        root_numel=sum(p.numel() for p in params if id(p) not in in_blocks),
        block_numel=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        matmul_numel=sum(matmul.values()),
        block_matmul_numel=sum(matmul.get(id(p), 0) for p in blocks[0].parameters()) if blocks else 0,
        mlp_activation=_mlp_activation(blocks[0]) if blocks else "",
        qk_norm=_qk_norm_keeps(blocks[0], spec.hidden) if blocks else None,
        qk_norms_per_head=_qk_norms_per_head(blocks[0], spec.head_dim) if blocks else False,
        fused_qkv=bool(block_modules & _FUSED_QKV),
        rotary=any("Rotary" in type(m).__name__ for m in module.modules()),
        loss_upcasts_logits="self.loss_function" in _forward_source(module),
        block_norms=_norms(blocks[0], spec.hidden) if blocks else (),
        block_norm_paths=_norm_paths(blocks[0]) if blocks else (),
        block_norm_param_numels=_norm_param_numels(_token_norms(blocks[0])) if blocks else (),
        root_norm_param_numels=_norm_param_numels(
            [(name, m) for name, m in _token_norms(module) if id(m) not in in_block_modules]),
        gated_mlp=any(name.rpartition(".")[2] in ("gate_proj", "gate_up_proj")
                      for name, _ in [*blocks[0].named_modules(), *blocks[0].named_parameters()]) if blocks else False,
        modules=_modules(module, blocks, params),
        expert_blocks=expert_blocks, dense_ffn=dense_ffn, shared_expert_width=shared_width,
        shared_expert_gated=shared_gated,
        input_linears=_input_linears(blocks[0]) if blocks else (1, 1),
        latent_attention=_latent_attention(blocks[0]) if blocks else None,
        saved_as_views=_saved_as_views(module, params),
        grouped_experts=any(_experts_implementation(m) == "grouped_mm" for m in module.modules()),
        explicit_mask="allow_is_causal_skip=False" in _forward_source(getattr(module, "base_model", module)),
        softmax_fp32=_softmax_in_fp32(blocks[0]) if blocks else False,
        rotary_concatenates="torch.cat(" in _function_source(blocks[0], "apply_rotary_pos_emb") if blocks else False,
    )


# The names transformers gives a projection that outputs queries, keys and values together.
_FUSED_QKV = frozenset({"query_key_value", "qkv_proj", "Wqkv", "c_attn"})


def _forward_source(module: nn.Module) -> str:
    """The source of the module's forward ("" where Python has none to give)."""
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def _softmax_in_fp32(block: nn.Module) -> bool:
    """``ParamLayout.softmax_fp32``, read from the source of the eager attention: transformers'
    ``eager_attention_forward`` of the module that defines the block, else the whole module
    (Bloom writes it in its attention's forward). No op traced on fake tensors tells it apart:
    under autocast every softmax computes in fp32."""
    source = _function_source(block, "eager_attention_forward")
    if not source:
        try:
            source = inspect.getsource(inspect.getmodule(type(block)))  # type: ignore[arg-type]
        except (OSError, TypeError):
            return False
    return re.search(r"softmax\([^)]*dtype=torch\.float32", source) is not None


def _function_source(block: nn.Module, name: str) -> str:
    """The source of the function ``name`` of the module that defines the block; "" where it
    has none, or where transformers has made it a module to swap in a hub kernel (LLaMA's
    and most decoders' ``apply_rotary_pos_emb``, which turn the whole query and concatenate
    nothing)."""
    function = getattr(inspect.getmodule(type(block)), name, None)
    try:
        return inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return ""


def _named(block: nn.Module, name: str) -> nn.Module | None:
    """The block's first submodule called ``name`` (at any depth), or None."""
    return next((m for path, m in block.named_modules() if path.rpartition(".")[2] == name), None)


def _linear(block: nn.Module | None, name: str) -> nn.Linear | None:
    """The block's first linear layer called ``name``, or None."""
    found = _named(block, name) if block is not None else None
    return found if isinstance(found, nn.Linear) else None


def _mlp_kinds(blocks: list[nn.Module]) -> tuple[tuple[bool, ...], int, int, bool]:
    """ParamLayout's expert_blocks, dense_ffn, shared_expert_width and shared_expert_gated."""
    routed = tuple(_named(block, "experts") is not None for block in blocks)
    if not any(routed):
        return (), 0, 0, False
    dense = next((block for block, experts in zip(blocks, routed, strict=True) if not experts), None)
    dense_gate = _linear(dense, "gate_proj")
    shared = next((m for block in blocks for name in ("shared_experts", "shared_expert")
                   if (m := _named(block, name)) is not None), None)
    shared_gate = _linear(shared, "gate_proj")
    return (routed, dense_gate.out_features if dense_gate else 0, shared_gate.out_features if shared_gate else 0,
            any(_named(block, "shared_expert_gate") is not None for block in blocks))


def _input_linears(block: nn.Module) -> tuple[int, int]:
    """ParamLayout.input_linears."""
    names = {path.rpartition(".")[2] for path, _ in block.named_modules()}
    attention = len(names & {"q_proj", "k_proj", "v_proj", "query", "key", "value", "q_a_proj", "kv_a_proj_with_mqa"})
    return max(1, attention), 2 if {"gate_proj", "up_proj"} <= names else 1


def _latent_attention(block: nn.Module) -> LatentAttention | None:
    """ParamLayout.latent_attention, read from the block's projections (DeepSeek's names)."""
    kv_a, kv_b = _linear(block, "kv_a_proj_with_mqa"), _linear(block, "kv_b_proj")
    query, o_proj = _linear(block, "q_b_proj") or _linear(block, "q_proj"), _linear(block, "o_proj")
    kv_norm = _named(block, "kv_a_layernorm")
    if kv_a is None or kv_b is None or query is None or o_proj is None or kv_norm is None:
        return None
    q_a = _linear(block, "q_a_proj")
    kv_rank = sum(p.numel() for p in kv_norm.parameters())  # its weight, one value per channel
    return LatentAttention(q_rank=q_a.out_features if q_a else 0, kv_latent=kv_a.out_features,
                           rope=kv_a.out_features - kv_rank, kv_up=kv_b.out_features, query=query.out_features,
                           value=o_proj.in_features)


def _saved_as_views(module: nn.Module, params: list[nn.Parameter]) -> frozenset[int]:
    """ParamLayout.saved_as_views: transformers' experts modules (their ``is_transposed`` and
    the config's ``_experts_implementation``, set by its use_experts_implementation)."""
    index = {id(p): i for i, p in enumerate(params)}
    return frozenset(index[id(p)] for m in module.modules()
                     if _experts_implementation(m) == "grouped_mm" and not m.is_transposed
                     for p in m.parameters(recurse=False) if p.dim() == 3)


def _experts_implementation(module: nn.Module) -> str | None:
    """How a transformers experts module runs its experts (None for any other module)."""
    if not hasattr(module, "is_transposed"):  # set by transformers' use_experts_implementation
        return None
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


def _modules(module: nn.Module, blocks: list[nn.Module], params: list[nn.Parameter]) -> tuple[
        tuple[int, tuple[int, ...]], ...]:
    """ParamLayout.modules."""
    index = {id(p): i for i, p in enumerate(params)}
    block_of = {id(m): b for b, block in enumerate(blocks) for m in block.modules()}
    return tuple((block_of.get(id(m), -1), tuple(index[id(p)] for p in m.parameters(recurse=False)))
                 for m in module.modules() if next(m.parameters(recurse=False), None) is not None)


def _is_matmul(module: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2's projections) is a linear layer with its weight transposed.
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _norms(block: nn.Module, width: int) -> tuple[NormKeeps, ...]:
    """ParamLayout.block_norms: what each of the block's token norms (``_token_norms``) keeps,
    each normalising ``width`` channels."""
    return tuple(_norm_keeps(m, width) for _, m in _token_norms(block))


def _norm_paths(block: nn.Module) -> tuple[str, ...]:
    return tuple(name for name, _ in _token_norms(block))


def _norm_param_numels(norms: list[tuple[str, nn.Module]]) -> tuple[int, ...]:
    return tuple(p.numel() for _, norm in norms for p in norm.parameters(recurse=False))


def _token_norms(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The block's normalisation modules (by class name: LayerNorm, LlamaRMSNorm,
    Gemma2RMSNorm, ...) but the attention's own: the per-head query and key norms and latent
    attention's norms of its latents (``LatentAttention``)."""
    # A convolution's BatchNorm or GroupNorm normalises images, not a token's channels: the
    # convnet's activations have their own formula.
    images = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)
    return [(name, m) for name, m in block.named_modules()
            if "Norm" in type(m).__name__ and not _in_attention_norm(name) and not isinstance(m, images)]


# The attention's own norms: per-head query and key norms (StableLM's and Persimmon's
# q_layernorm, a module list of per-head LayerNorms in StableLM's), latent attention's.
_ATTENTION_NORMS = frozenset({"q_norm", "k_norm", "q_layernorm", "k_layernorm", "q_a_layernorm", "kv_a_layernorm"})


def _in_attention_norm(path: str) -> bool:
    """Whether the module at ``path`` is one of the attention's own norms or inside one."""
    return not _ATTENTION_NORMS.isdisjoint(path.split("."))


def _qk_norm_keeps(block: nn.Module, width: int) -> NormKeeps | None:
    """``ParamLayout.qk_norm``: what the block's query norm keeps (Qwen3's ``q_norm``,
    Persimmon's and StableLM's ``q_layernorm``; StableLM's is a LayerNorm a head over views of
    one tensor, probed through its first), or None where it has none."""
    norm = _named(block, "q_norm")
    if norm is None:
        norm = _named(block, "q_layernorm")
    if norm is None:
        return None
    per_head = getattr(norm, "norms", None)
    return _norm_keeps(per_head[0] if isinstance(per_head, nn.ModuleList) else norm, width)


def _qk_norms_per_head(block: nn.Module, head_dim: int) -> bool:
    """``ParamLayout.qk_norms_per_head``."""
    norms = [_named(block, name) for name in ("q_norm", "k_norm")]
    return all(norm is not None and not isinstance(norm, nn.ModuleList) and _normalised_width(norm, 0) == head_dim
               for norm in norms)


def _normalised_width(norm: nn.Module, width: int) -> int:
    """The channels ``norm`` normalises: its ``normalized_shape``'s or its weight's, else ``width``."""
    shape = getattr(norm, "normalized_shape", None)
    weight = getattr(norm, "weight", None)
    if shape:
        return int(shape[-1])
    return int(weight.shape[-1]) if isinstance(weight, torch.Tensor) and weight.dim() else width


# What a norm whose forward takes more than its input (Qwen3-Next's gated RMSNorm) is counted
# at, by its class name, since the probe cannot call it: LLaMA's RMSNorm's, or a LayerNorm's
# (also what a model whose blocks name no norm is taken to have).
_RMSNORM_KEEPS = NormKeeps(fp32=8.0, half=6.0)
LAYERNORM_KEEPS = NormKeeps(fp32=4.0, half=2.0)


def _norm_keeps(norm: nn.Module, width: int) -> NormKeeps:
    """What ``norm`` (on the meta device, as param_layout builds it) saves for backward per
    element of its input: the bytes of its saved tensors (each storage once) from a meta input
    of four tokens less those from two, over two tokens' elements, so that what it derives from
    its weight alone (Gemma's 1 + weight, once a forward) is left out. Run with gradients on and
    outside any dispatch mode (a traced step, whose fake mode and op counting must not see it,
    may ask for the layout first)."""
    required = [p for p in inspect.signature(norm.forward).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > 1:
        return _RMSNORM_KEEPS if "RMS" in type(norm).__name__ else LAYERNORM_KEEPS
    channels = _normalised_width(norm, width)

    def saved_bytes(tokens: int, dtype: torch.dtype) -> int:
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            saved[storage._cdata] = storage.nbytes()
            return tensor

        with _disable_current_modes(), torch.enable_grad():
            x = torch.empty(tokens, channels, dtype=dtype, device="meta", requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                norm(x)
        return sum(saved.values())

    def per_element(dtype: torch.dtype) -> float:
        return (saved_bytes(4, dtype) - saved_bytes(2, dtype)) / (2 * channels)

    return NormKeeps(fp32=per_element(torch.float32), half=per_element(torch.bfloat16))


def _mlp_activation(block: nn.Module) -> str:
    """The class name of the first activation module inside the block's MLP (or the block)."""
    mlp = getattr(block, "mlp", None) or block
    for m in mlp.modules():
        name = type(m).__name__
        if "Activation" in name or name in ("GELU", "SiLU", "ReLU", "GELUTanh", "Tanh"):
            return name
    return ""


@dataclass
class BuiltModel:
    """A randomly initialised model and how to feed it.

    `block_type` is the repeated layer class: the unit for activation checkpointing and for
    FSDP / ZeRO-3 sharding. `make_batch` draws from the given generator only, so drawing the
    global batch once and slicing `tensor[rank*mb:(rank+1)*mb]` gives every rank its share of
    exactly the batch a single-process run sees; every tensor's first dimension is the batch.
    """

    spec: ModelSpec
    module: nn.Module
    block_type: type[nn.Module]
    n_params: int
    tokens_per_sample: int
    flops_per_sample: float
    attn_implementation: str | None  # as HF resolved it; None for the plain-torch mlp

    def make_batch(self, generator: torch.Generator, batch_size: int) -> dict[str, torch.Tensor]:
        return _FAMILIES[self.spec.family].make_batch(self.spec, generator, batch_size)

    def loss(self, module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scalar mean loss; `module` may be this model wrapped by a strategy (DDP, FSDP, ...)."""
        return _FAMILIES[self.spec.family].loss(module, batch)

    def loss_and_correct(self, module: nn.Module,
                         batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The mean loss and, for a classifier whose family counts them, the samples it
        classifies right (None otherwise)."""
        family = _FAMILIES[self.spec.family]
        if hasattr(family, "loss_and_correct"):
            loss, correct = family.loss_and_correct(module, batch)
            return loss, correct
        return family.loss(module, batch), None


def build(spec: ModelSpec, *, seed: int = 0, attention: str = "sdpa",
          router_aux_loss_coef: float | None = None) -> BuiltModel:
    """Build on CPU with weights that depend on `seed` only, identical on every rank.
    ``attention``: CellSpec.attention (which kernel, not which weights);
    ``router_aux_loss_coef``: CellSpec's, for the moe family (moe.with_router_aux_loss)."""
    family = _FAMILIES[spec.family]
    # Models are initialised on CPU, so the CPU generator is all that is seeded; fork_rng
    # restores it afterwards, leaving the caller's RNG (and any CUDA RNG) untouched.
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        module = family.build_module(spec, attention)
    if router_aux_loss_coef is not None:
        moe.with_router_aux_loss(module, router_aux_loss_coef)
    config = getattr(module, "config", None)
    return BuiltModel(
        spec=spec,
        module=module,
        block_type=layouts.block_type(module),
        n_params=sum(p.numel() for p in module.parameters()),
        tokens_per_sample=spec.tokens_per_sample,
        flops_per_sample=flops_per_sample(spec),
        # transformers names one even for a model without attention (Mamba: "eager").
        attn_implementation=getattr(config, "_attn_implementation", None) if spec.has_attention else None,
    )
