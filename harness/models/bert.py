"""BERT (Devlin et al. 2019) masked-LM pre-training through transformers' BertForMaskedLM."""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM

from .common import ParamCount, hf_attention, hf_loss, linear
from .spec import ModelSpec

loss = hf_loss
MASK_FRACTION = 0.15  # BERT's masking rate
TYPE_VOCAB = 2  # segment A / B


def build_module(spec: ModelSpec, attention: str = "sdpa") -> nn.Module:
    # attn_implementation goes through the config's **kwargs, which its dataclass signature does not declare.
    config = BertConfig(  # type: ignore[call-arg]
        vocab_size=spec.required("vocab_size"), hidden_size=spec.hidden, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.required("n_heads"), intermediate_size=spec.ffn,
        max_position_embeddings=spec.required("seq_len"), type_vocab_size=TYPE_VOCAB,
        # Dropout draws from each rank's RNG, which would break equality with the 1-process run.
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0,
        attn_implementation=hf_attention(attention),
    )
    return BertForMaskedLM(config)


def n_masked(spec: ModelSpec) -> int:
    return max(1, round(MASK_FRACTION * spec.required("seq_len")))


def make_batch(spec: ModelSpec, generator: torch.Generator, batch_size: int) -> dict[str, torch.Tensor]:
    """Random ids with the same number of masked positions in every sample.

    The loss is the mean over masked tokens; with an equal count per sample the mean over
    the global batch equals the mean of per-rank means, as data-parallel training assumes.
    The last vocabulary id stands for [MASK] and is never drawn as an ordinary token.
    """
    mask_id, seq_len = spec.required("vocab_size") - 1, spec.required("seq_len")
    tokens = torch.randint(mask_id, (batch_size, seq_len), generator=generator)
    # The first n_masked positions of a random permutation per sample: distinct, uniform.
    order = torch.rand(batch_size, seq_len, generator=generator).argsort(dim=1)
    masked = torch.zeros_like(tokens, dtype=torch.bool).scatter_(1, order[:, : n_masked(spec)], True)
    return {
        "input_ids": tokens.masked_fill(masked, mask_id),
        "labels": tokens.masked_fill(~masked, -100),  # -100: ignored by the loss
    }


def count_params(spec: ModelSpec) -> ParamCount:
    h, f, v = spec.hidden, spec.ffn, spec.required("vocab_size")
    block = 4 * linear(h, h) + 2 * h + linear(h, f) + linear(f, h) + 2 * h
    embedding = (v + spec.required("seq_len") + TYPE_VOCAB) * h
    # Embedding LayerNorm; MLM head: transform dense + LayerNorm, decoder tied but its own bias.
    extra = 2 * h + linear(h, h) + 2 * h + v
    # The decoder's weight is the token table, yet the decoder is a V x h matmul every forward.
    return ParamCount(embedding + spec.n_layers * block + extra, embedding, tied_head=v * h)
