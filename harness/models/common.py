"""Pieces the family files share: parameter counts, causal-LM batches, the HF loss."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from .spec import ModelSpec


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Where a model is built on the meta device for its sizes and layout: outside any fake
    tensor mode, since a traced step (predict/traced.py) may ask for them first, and a tensor
    a module makes in its __init__ from a Python number (Gemma's embedding scale) would then be
    a meta tensor the fake mode refuses."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.device("meta"):
        yield


class ParamCount(NamedTuple):
    """Parameter counts from the spec alone, so real sizes can be planned without building."""

    total: int  # every parameter, a tied weight once
    embedding: int  # lookup tables (token, position, ...): the lookup is no matmul, so no FLOPs
    # A LM head whose weight is the token table: counted once above (inside `embedding`), but
    # it is a V x h matmul in every forward all the same, so it is credited with FLOPs.
    tied_head: int = 0
    # Parameters a token does not pass through: in a mixture of experts, the experts it is not
    # routed to. Counted in `total` (they are held and trained), not in the FLOPs.
    inactive: int = 0

    @property
    def matmul(self) -> int:
        """N of the PaLM FLOPs formula: every parameter a token passes through but the lookups,
        the LM head included.

        Tied or untied, a LM head adds the same V*h here; a mixture of experts counts its
        router and the top_k experts a token is routed to, not the others.
        """
        return self.total - self.embedding + self.tied_head - self.inactive


@functools.cache
def counted_on_meta(build_module: Callable[[ModelSpec], nn.Module], spec: ModelSpec) -> ParamCount:
    """``spec``'s parameters counted on the module ``build_module`` builds on the meta device
    (no memory, milliseconds even for billions): what the families without a formula of
    their own (a transformers config, a factory) count."""
    with on_meta():
        module = build_module(spec)
    return count_module(module)


def count_module(module: nn.Module) -> ParamCount:
    params = list(module.parameters())  # a tied weight once
    tables = [m.weight for m in module.modules() if isinstance(m, nn.Embedding)]
    head = getattr(module, "get_output_embeddings", lambda: None)()
    tied = head is not None and any(head.weight is t for t in tables)
    return ParamCount(total=sum(p.numel() for p in params), embedding=sum(t.numel() for t in tables),
                      tied_head=head.weight.numel() if head is not None and tied else 0,
                      inactive=_inactive_experts(module))


def _inactive_experts(module: nn.Module) -> int:
    """The routed experts' parameters a token does not pass through: of each module named
    ``experts`` (transformers' experts of Mixtral, Qwen-MoE, OLMoE, DeepSeek, GLM-4.5, gpt-oss,
    their weights stacked over ``num_experts``; or an nn.ModuleList of one module an expert),
    all but the share ``num_experts_per_tok / num_experts`` of the model's config. A shared
    expert and a dense block are not named so and count whole. 0 where the model has no
    config saying how many experts a token goes to (a factory's own module)."""
    top_k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
    if not isinstance(top_k, int):
        return 0
    inactive = 0
    for name, experts in module.named_modules():
        if name.rpartition(".")[2] != "experts":
            continue
        n_experts = len(experts) if isinstance(experts, nn.ModuleList) else experts.num_experts
        numel = sum(p.numel() for p in experts.parameters())
        inactive += numel * (n_experts - top_k) // n_experts
    return inactive


# CellSpec.attention -> transformers' attn_implementation.
_HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}


def hf_attention(attention: str) -> str:
    return _HF_ATTENTION[attention]


def llama_style_config(spec: ModelSpec, attention: str) -> dict[str, Any]:
    """The keyword arguments a transformers config of a LLaMA-style decoder (Llama's, and
    Mixtral's around its experts) takes from ``spec``."""
    return dict(
        vocab_size=spec.required("vocab_size"), hidden_size=spec.hidden, intermediate_size=spec.ffn,
        num_hidden_layers=spec.n_layers, num_attention_heads=spec.required("n_heads"),
        num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.required("seq_len"),
        use_cache=False,  # a KV cache is for generation and clashes with activation checkpointing
        bos_token_id=None, eos_token_id=None,  # the defaults lie outside tiny vocabularies
        attn_implementation=hf_attention(attention),
    )


def linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def grouped_query_attention_params(spec: ModelSpec) -> int:
    """q and o over all heads, k and v over the key/value heads; no biases (Llama, Mixtral)."""
    d, n_heads = spec.head_dim, spec.required("n_heads")
    return (linear(spec.hidden, n_heads * d, False) + 2 * linear(spec.hidden, spec.kv_heads * d, False)
            + linear(n_heads * d, spec.hidden, False))


def causal_lm_batch(spec: ModelSpec, generator: torch.Generator, batch_size: int) -> dict[str, torch.Tensor]:
    """Random token ids; labels = input_ids because HF models shift the labels themselves.

    Every sample has seq_len - 1 predicted tokens, so the mean over a batch equals the mean
    of the per-slice means over equal slices of it.
    """
    input_ids = torch.randint(spec.required("vocab_size"), (batch_size, spec.required("seq_len")), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def hf_loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF models compute their mean loss when given labels."""
    return module(**batch).loss
