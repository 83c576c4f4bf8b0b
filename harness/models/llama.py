"""Llama (Touvron et al. 2023; Llama 3) through transformers' LlamaForCausalLM."""

from __future__ import annotations

from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from .common import ParamCount, causal_lm_batch, grouped_query_attention_params, hf_loss, linear, llama_style_config
from .spec import ModelSpec

make_batch = causal_lm_batch
loss = hf_loss


def build_module(spec: ModelSpec, attention: str = "sdpa") -> nn.Module:
    config = LlamaConfig(**llama_style_config(spec, attention), tie_word_embeddings=spec.tie_embeddings)
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
