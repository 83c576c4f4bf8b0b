"""GPT-2 (Radford et al. 2019) through transformers' GPT2LMHeadModel."""

from __future__ import annotations

from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from .common import ParamCount, causal_lm_batch, hf_attention, hf_loss, linear
from .spec import ModelSpec

make_batch = causal_lm_batch
loss = hf_loss


def build_module(spec: ModelSpec, attention: str = "sdpa") -> nn.Module:
    # attn_implementation goes through the config's **kwargs, which its dataclass signature does not declare.
    config = GPT2Config(  # type: ignore[call-arg]
        vocab_size=spec.required("vocab_size"), n_positions=spec.required("seq_len"), n_embd=spec.hidden,
        n_layer=spec.n_layers, n_head=spec.required("n_heads"), n_inner=spec.ffn,
        # Dropout draws from each rank's RNG, which would break equality with the 1-process run.
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        use_cache=False,  # a KV cache is for generation and clashes with activation checkpointing
        bos_token_id=None, eos_token_id=None,  # the defaults (50256) lie outside tiny vocabularies
        attn_implementation=hf_attention(attention),
    )
    module = GPT2LMHeadModel(config)
    # HF picks the loss from the class name, and "LMHeadModel" names none: it would warn and
    # fall back to this same causal-LM loss. Say so explicitly.
    module.loss_type = "ForCausalLM"
    return module


def count_params(spec: ModelSpec) -> ParamCount:
    h, f, v = spec.hidden, spec.ffn, spec.required("vocab_size")
    block = 2 * h + linear(h, 3 * h) + linear(h, h) + 2 * h + linear(h, f) + linear(f, h)
    embedding = v * h + spec.required("seq_len") * h
    # The LM head is tied to the token table (no parameters of its own) but still a V x h matmul.
    return ParamCount(embedding + spec.n_layers * block + 2 * h, embedding, tied_head=v * h)
