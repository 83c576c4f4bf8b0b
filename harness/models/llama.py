"""Llama (Touvron et al. 2023; Llama 3) through transformers' LlamaForCausalLM."""

from __future__ import annotations

from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from .common import ParamCount, causal_lm_batch, grouped_query_attention_params, hf_attention, hf_loss, linear
from .spec import ModelSpec

make_batch = causal_lm_batch
loss = hf_loss


def build_module(spec: ModelSpec, attention: str = "sdpa") -> nn.Module:
    # attn_implementation goes through the config's **kwargs, which its dataclass signature does not declare.
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=spec.required("vocab_size"), hidden_size=spec.hidden, intermediate_size=spec.ffn,
        num_hidden_layers=spec.n_layers, num_attention_heads=spec.required("n_heads"),
        num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.required("seq_len"),
        tie_word_embeddings=spec.tie_embeddings,
        use_cache=False,  # a KV cache is for generation and clashes with activation checkpointing
        bos_token_id=None, eos_token_id=None,  # the defaults lie outside tiny vocabularies
        attn_implementation=hf_attention(attention),
    )
    return LlamaForCausalLM(config)


def count_params(spec: ModelSpec) -> ParamCount:
    h, f, v = spec.hidden, spec.ffn, spec.required("vocab_size")
    attention = grouped_query_attention_params(spec)
    block = h + attention + h + 3 * linear(h, f, False)  # two RMSNorms, SwiGLU gate/up/down
    embedding = v * h
    # The LM head is a V x h matmul either way: untied it has its own parameters; tied it has
    # none, but is credited with the same FLOPs, so tied and untied models compare.
    head = v * h
    if spec.tie_embeddings:
        return ParamCount(embedding + spec.n_layers * block + h, embedding, tied_head=head)
    return ParamCount(embedding + spec.n_layers * block + h + head, embedding)
