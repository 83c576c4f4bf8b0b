"""What every strategy file provides:

- ``CAPABILITIES``: the feature values it composes with;
- ``prepare(model, block_type, cell, env) -> Prepared``: the built (and, if asked,
  checkpoint-wrapped) model wrapped for the strategy, with its optimizer, how to skip
  gradient synchronisation on accumulation micro-steps, and how the forward pass is cast;
- optionally ``unsupported_reason(cell, device_type) -> str | None``: why this hardware cannot
  run a cell (recorded as an ``unsupported`` result).

The worker's training step is the same for every strategy; everything that differs lives
behind ``Prepared``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn


ALL_PRECISIONS = frozenset({"fp32", "bf16", "fp16"})
ALL_CHECKPOINTING = frozenset({"none", "full", "selective"})


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """Which feature values a strategy composes with. Anything else is rejected when the
    matrix is built, with the reason, before a process is launched."""

    precisions: frozenset[str] = ALL_PRECISIONS
    checkpointing: frozenset[str] = ALL_CHECKPOINTING
    offload: frozenset[str] = frozenset({"none"})
    compression: frozenset[str] = frozenset({"none"})
    accumulation: bool = True
    min_world_size: int = 2
    max_world_size: int | None = None
    # Why a value is refused, for the values that need explaining.
    notes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Prepared:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    # Entered around forward+backward of every micro-step but the last of an optimizer step.
    no_sync: Callable[[], AbstractContextManager] = nullcontext
    # False where the strategy casts parameters itself (FSDP mixed-precision policies).
    use_autocast: bool = True
    # FSDP2 models are measured with FSDPMemTracker, which knows their sharded parameters.
    fsdp2: bool = False


# Both FSDP generations: bf16 via their mixed-precision policies; fp16 would need a sharded
# GradScaler, which is not wired yet.
FSDP_CAPABILITIES = Capabilities(
    precisions=frozenset({"fp32", "bf16"}),
    offload=frozenset({"none", "params"}),
    notes={"fp16": "fp16 with FSDP needs a sharded GradScaler, not wired in this release: use bf16"},
)
