"""The optimizer every strategy builds: torch's AdamW with its defaults and the cell's lr.

One definition, so that a sharded optimizer (ZeRO-1, FSDP) and the single-process reference
run the same update rule and the equivalence gate compares like with like. Wrappers that
construct the optimizer themselves (ZeroRedundancyOptimizer) take the class and kwargs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

OPTIMIZER_CLASS = torch.optim.AdamW


def optimizer_kwargs(lr: float) -> dict:
    return {"lr": lr}


def adamw(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return OPTIMIZER_CLASS(params, **optimizer_kwargs(lr))
