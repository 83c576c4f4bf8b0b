"""A sparse mixture-of-experts decoder (Mixtral, Jiang et al. 2024) through transformers'
MixtralForCausalLM: Llama's attention, and in place of its MLP a router that sends every token
to the top_k of n_experts SwiGLU experts."""

from __future__ import annotations

from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM

from .common import ParamCount, causal_lm_batch, grouped_query_attention_params, hf_loss, linear, llama_style_config
from .spec import ModelSpec

make_batch = causal_lm_batch
loss = hf_loss


def build_module(spec: ModelSpec, attention: str = "sdpa") -> nn.Module:
    # experts_implementation goes through the config's **kwargs, which its dataclass signature
    # does not declare.
    config = MixtralConfig(  # type: ignore[call-arg]
        **llama_style_config(spec, attention),
        num_local_experts=spec.required("n_experts"), num_experts_per_tok=spec.required("top_k"),
        # The loss is the plain LM loss, without the load-balancing auxiliary loss unless a
        # cell asks for it (with_router_aux_loss, below; not gated where ranks split the batch): that loss
        # multiplies the batch's fraction of tokens per expert by its mean router probability,
        # which is not a mean over samples, so the loss of a global batch would no longer be
        # the mean of its per-rank slices' losses, the premise of the equivalence check. The
        # router still learns, through the routing weights that scale the experts' outputs.
        output_router_logits=False,
        router_jitter_noise=0.0,  # noise draws from each rank's RNG, as dropout would
        # HF's default, named so that a change of default cannot change the benchmark:
        # all experts' 3-D weights in one grouped matmul rather than a loop over experts.
        experts_implementation="grouped_mm",
    )
    return MixtralForCausalLM(config)


def with_router_aux_loss(module: MixtralForCausalLM, coef: float) -> None:
    """Add transformers' load-balancing loss to ``module``'s loss, times ``coef``: per layer,
    n_experts × Σ over experts of (fraction of the top_k picks it got) × (its mean router
    probability), over the tokens of the forward (Fedus et al. 2022, §2.2). Those fractions
    and means are over the batch a forward sees, not per sample: see the equivalence gate
    for what that means for a rank's share of the batch."""
    module.config.output_router_logits = True  # read at every forward
    module.router_aux_loss_coef = coef


def _experts(spec: ModelSpec, n: int) -> int:
    """Parameters of n SwiGLU experts (gate, up, down; no biases)."""
    return n * 3 * linear(spec.hidden, spec.ffn, False)


def count_params(spec: ModelSpec) -> ParamCount:
    h, v, n_experts = spec.hidden, spec.required("vocab_size"), spec.required("n_experts")
    attention = grouped_query_attention_params(spec)
    router = linear(h, n_experts, False)
    block = h + attention + h + router + _experts(spec, n_experts)  # two RMSNorms
    embedding = v * h
    head = v * h  # untied, as in Mixtral
    # Each token runs through top_k experts; the other n_experts - top_k hold no FLOPs for it.
    inactive = spec.n_layers * _experts(spec, n_experts - spec.required("top_k"))
    return ParamCount(embedding + spec.n_layers * block + h + head, embedding, inactive=inactive)
