"""Mixtures of experts and expert parallelism: parameters held, token all-to-alls."""

from __future__ import annotations


def moe_params(*, shared: int, expert: int, n_experts: int, top_k: int, layers: int) -> tuple[int, int]:
    """(total, active) parameters of a mixture of experts: every expert is held and trained,
    a token passes through top_k of them per layer (Shazeer et al. 2017; Fedus et al. 2022,
    Switch Transformers; Mixtral, Jiang et al. 2024: 46.7B total, 12.9B active).
    ``shared``: every parameter outside the experts (attention, norms, routers, embeddings,
    head); ``expert``: one expert's parameters. Model states (ZeRO's 16Ψ) scale with the
    total, training FLOPs (6·N per token) with the active count."""
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k}: between 1 and n_experts={n_experts}")
    return shared + layers * n_experts * expert, shared + layers * top_k * expert


def expert_parallel_local_params(*, shared: int, expert: int, n_experts: int, layers: int, ep: int) -> int:
    """Parameters one rank holds under expert parallelism over ``ep`` ranks (GShard, Lepikhin
    et al. 2021; DeepSpeed-MoE, Rajbhandari et al. 2022): everything outside the experts
    whole, as data parallelism keeps it, and n_experts/ep of each MoE layer's experts:
    shared + layers·(n_experts/ep)·expert. Each state follows its parameter."""
    if ep < 1 or n_experts % ep:
        raise ValueError(f"ep={ep}: must divide n_experts={n_experts}")
    return shared + layers * (n_experts // ep) * expert


def expert_parallel_all_to_all_bytes(tokens: int, hidden: int, top_k: int, n_experts: int, layers: int, ep: int, *,
                                     received_rows: float | None = None, value_bytes: float = 4,
                                     recomputed_per_layer: int = 0) -> float:
    """Input bytes of a rank's all-to-alls per forward + backward of its ``tokens`` tokens:
    GShard's dispatch and combine (Lepikhin et al. 2021) without a capacity limit (dropless,
    as MegaBlocks, Gale et al. 2023), as DeepSpeed AutoEP runs them
    (deepspeed/module_inject/auto_ep_layer.py, 0.19.8), per MoE layer:
      forward: the int32 per-expert token counts (n_experts values); the dispatch of this
        rank's tokens·top_k routed rows of h values; the return of the ``received_rows``
        rows its own experts computed;
      backward: the return's gradient (tokens·top_k rows) and the dispatch's
        (``received_rows``);
    a recomputed forward repeats its three. The rows a rank sends are fixed, the rows it
    receives depend on the routing: ``received_rows`` defaults to the balanced tokens·top_k,
    which is also exactly the mean over ranks (every rank routes tokens·top_k rows and each
    lands on one rank); ``expert_parallel_most_received_rows`` is the worst case. Nothing at
    ep = 1 (AutoEP computes locally)."""
    if ep == 1:
        return 0.0
    sent = tokens * top_k
    received = sent if received_rows is None else received_rows
    rows = (sent + received) * hidden * value_bytes
    counts = 4 * n_experts
    return layers * ((1 + recomputed_per_layer) * (counts + rows) + rows)


def expert_parallel_most_received_rows(tokens: int, top_k: int, n_experts: int, ep: int) -> int:
    """The most routed rows one rank's experts can receive in a layer: every rank's tokens
    all choosing this rank's experts, each token at most min(top_k, n_experts/ep) of them
    (its top_k experts are distinct): ep·tokens·min(top_k, n_experts/ep). The bound of dropless
    routing (Gale et al. 2023, MegaBlocks), where GShard's capacity factor would drop tokens."""
    return ep * tokens * min(top_k, n_experts // ep)
