"""How evenly a mixture of experts' routers spread the tokens: tokens per expert, per step and
layer, and their imbalance.

Counted by a forward hook on each router (transformers' ``MixtralTopKRouter``, which returns
the top_k experts it picked for every token): each pick adds one to its expert's count for
the step in progress. Only the training forward counts: not the held-out evaluation (no
grad) and not a checkpointed block's recompute in backward (the same picks again). The
count is a few small ops per layer and micro-step on the router's own output, in every
step, timed ones included (a ``top_k × tokens`` index add beside the experts' matmuls).

Imbalance (Fedus et al. 2022, Switch Transformer, §2.2; Lepikhin et al. 2021, GShard): a
layer's most loaded expert's tokens over the mean per expert, 1.0 when perfectly even and
n_experts when one expert takes every pick; a step's is the mean over its layers. The
experts' compute follows the most loaded one, and a capacity-limited router (GShard,
Switch) drops what exceeds capacity; Mixtral's has no capacity, so no token is dropped.

Across ranks: a data-parallel rank routes its own tokens through every layer, so the global
batch's counts are the sum over ranks (one all-reduce after the last step). Where ranks split
the model (tensor, pipeline, expert parallel) a rank sees another share of the routing and
the counts are not taken (``NOT_MEASURED``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Why the record has no dropped-token count (module docstring).
NO_CAPACITY = "Mixtral's router has no capacity limit: every token goes to its top_k experts, none is dropped"
NOT_MEASURED = ("the ranks split the model (tensor, pipeline or expert parallel): a rank's routers see another"
                " share of the routing than a data-parallel rank's, so the counts are not summed")


def routers(module: nn.Module) -> list[nn.Module]:
    """The model's routers, first layer first (none for a model without experts)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    return [m for m in module.modules() if isinstance(m, MixtralTopKRouter)]


class ExpertLoad:
    """Counts per step, layer and expert (module docstring); ``step`` is the step in progress,
    set by the training loop before each step."""

    def __init__(self, module_routers: list[nn.Module], steps: int, device: torch.device) -> None:
        n_experts: set[int] = {r.num_experts for r in module_routers}  # type: ignore[misc]  # an int attribute
        if len(n_experts) != 1:
            raise ValueError(f"routers with different numbers of experts: {sorted(n_experts)}")
        self.counts = torch.zeros(steps, len(module_routers), n_experts.pop(), dtype=torch.int64, device=device)
        self.step = 0
        self._handles = [r.register_forward_hook(self._counter(layer)) for layer, r in enumerate(module_routers)]

    def _counter(self, layer: int):  # type: ignore[no-untyped-def]  # a forward hook
        def count(router: nn.Module, inputs: Any, outputs: tuple[torch.Tensor, ...]) -> None:
            # -1 outside backward: a checkpointed block's recompute runs inside it.
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return
            picks = outputs[-1].reshape(-1)  # each token's top_k expert indices
            self.counts[self.step, layer].index_add_(0, picks, torch.ones_like(picks))

        return count

    def to_record(self, summed_over_ranks: bool) -> dict[str, Any]:
        """The counts (summed over the ranks where ``summed_over_ranks``: a collective every
        rank must call) and each step's imbalance."""
        counts = self.counts.clone()
        if summed_over_ranks and dist.is_initialized():
            dist.all_reduce(counts)
        for handle in self._handles:
            handle.remove()
        return {"tokens_per_expert": counts.tolist(), "imbalance": imbalance(counts).tolist(),
                "summed_over_ranks": summed_over_ranks, "dropped_tokens": None, "dropped_tokens_reason": NO_CAPACITY}


def imbalance(counts: torch.Tensor) -> torch.Tensor:
    """Per step: the mean over layers of (most loaded expert's tokens ÷ mean tokens per expert);
    ``counts`` is (steps, layers, experts)."""
    per_layer = counts.amax(dim=-1).double() / counts.double().mean(dim=-1)
    return per_layer.mean(dim=-1)
