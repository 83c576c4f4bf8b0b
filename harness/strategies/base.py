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
    optimizers: frozenset[str] = frozenset({"adamw"})
    compression: frozenset[str] = frozenset({"none"})
    accumulation: bool = True
    min_world_size: int = 2
    max_world_size: int | None = None
    # Why a value is refused, for the values that need explaining.
    notes: dict[str, str] = field(default_factory=dict)


def _no_op() -> None:
    pass


def _nothing_to_report() -> dict:
    return {}


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
    # torch 2 zeroes gradients by setting them to None; FairScale's ShardedDataParallel
    # keeps references to the .grad tensors and silently reduces wrong gradients then.
    grads_set_to_none: bool = True
    # Engines that own the backward pass and the optimizer step (DeepSpeed) replace the
    # GradScaler path: ``backward(loss)`` for each micro-step's (already 1/accumulation
    # scaled) loss, ``after_micro_step()`` after each, and no optimizer step of the harness.
    backward: Callable[[torch.Tensor], None] | None = None
    after_micro_step: Callable[[], None] = _no_op
    # The tensors the memory tracker should attribute as model and optimizer state, where
    # the engine's wrappers hide them (DeepSpeed: engine.module, the wrapped torch optimizer).
    memory_module: nn.Module | None = None
    memory_optimizer: torch.optim.Optimizer | None = None
    # Tensors the engine made before the step and holds outside both (DeepSpeed's fp32
    # master partitions and ZeRO-3's parameter partitions): the tracker cannot find them.
    memory_held: Callable[[], list[torch.Tensor]] = list
    # Engine-specific measurements for the record's per-rank ``engine`` entry (DeepSpeed's
    # comms_logger and memory estimators), read after the last step.
    engine_report: Callable[[], dict] = _nothing_to_report
    # Which share of each step's samples this rank takes: the index of its data-parallel
    # group (None: its rank). Ranks that split the model rather than the batch (tensor and
    # pipeline parallel) share an index; how many groups there are is the cell's
    # ``strategy.data_parallel_size``.
    data_rank: int | None = None
    # Strategies that run forward and backward of a micro-step themselves (a pipeline's
    # schedule, context parallel's sharded sequence): given the micro-step's batch, it
    # backpropagates that micro-step's loss already divided by the accumulation count (as the
    # worker's own path does) and returns it on the ranks that compute one (``holds_loss``),
    # None on the others. None: the worker's own forward and backward.
    forward_backward: Callable[[dict], torch.Tensor | None] | None = None
    holds_loss: bool = True

    @property
    def owns_optimizer_step(self) -> bool:
        return self.backward is not None


# Both FSDP generations: bf16 via their mixed-precision policies; fp16 would need a sharded
# GradScaler, which is not wired yet.
FSDP_CAPABILITIES = Capabilities(
    precisions=frozenset({"fp32", "bf16"}),
    offload=frozenset({"none", "params"}),
    notes={"fp16": "fp16 with FSDP needs a sharded GradScaler, not wired in this release: use bf16"},
)
