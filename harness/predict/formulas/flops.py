"""Model FLOPs of a training step (Korthikanti et al. 2022)."""

from __future__ import annotations


def model_flops_per_step(batch: int, layers: int, seq: int, hidden: int, vocab: int, *,
                         selective_recompute: bool = False) -> float:
    """Korthikanti et al. 2022, App. A: 72·B·L·s·h²·(1 + s/(6h) + V/(12hL)) model FLOPs per
    step (forward + backward); with selective recompute the hardware FLOPs, s/(3h) in place
    of s/(6h)."""
    attention = seq / (3 * hidden) if selective_recompute else seq / (6 * hidden)
    return 72 * batch * layers * seq * hidden**2 * (1 + attention + vocab / (12 * hidden * layers))
