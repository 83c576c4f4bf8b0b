"""What every strategy file provides: its capabilities and a ``prepare`` function.

``prepare`` takes a built (and, if asked, checkpoint-wrapped) model and returns it wrapped
for the strategy with its optimizer, how to skip gradient synchronisation on accumulation
micro-steps, and how the forward pass is cast. The worker's training step is the same for
every strategy; everything that differs lives behind this record.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from harness.config import CellSpec
from harness.distributed import DistEnv

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


class Strategy(Protocol):
    CAPABILITIES: Capabilities

    def prepare(self, model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared: ...

    def unsupported_reason(self, cell: CellSpec, device_type: str) -> str | None: ...
