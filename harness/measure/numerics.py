"""A cell's numerics: per step the loss scale, the steps skipped for overflow and the global
gradient norm before clipping, and on one step how the gradients fall in the compute
precision's range. The record's ``numerics`` (README "Results format").

- loss_scale: the scale after each step (GradScaler's, or DeepSpeed's own scaler's); null
  where the cell has none (fp32, bf16).
- skipped_steps: the steps whose update was skipped for an inf or nan gradient. GradScaler
  lowers its scale exactly when it skips (it grows the scale only after 2000 clean steps):
  a step after which the scale fell was skipped. DeepSpeed counts its own (``skipped_steps``).
- grad_norm: the 2-norm of every gradient of the model, unscaled, before clipping
  (features/clipping.py computes it each engine's way). Computing it takes a pass over the
  gradients and, where they are sharded, a collective: a cell that clips computes it every
  step anyway; one that does not has it measured only in its warm-up steps, so that no timed,
  memory-tracked or comm-counted step pays for it (null for those steps). DeepSpeed computes
  it inside every step itself; a pipeline's ranks sum their stages' squares over the
  pipeline (strategies/pipeline.py). Null throughout for the strategies that cannot clip
  (Megatron: each rank holds a part of the model, and no global norm is wired).
- gradient_range (fp16 and bf16 cells): the last warm-up step's gradients, as the backward
  left them for the optimizer (multiplied by the loss scale), cast to the compute precision:
  how many are zero or subnormal there, and how many would be without the loss scale — the
  measurement behind Micikevicius et al. 2018's case for loss scaling (their Figure 3 is the
  histogram of log2|g|, kept here by binary exponent). Counted over the gradients each rank's
  optimizer steps (its shard where they are sharded) and summed over the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from harness.distributed import is_dtensor

# frexp's exponents of float32 values (|g| = m·2^e, 0.5 ≤ m < 1) run from -148 to 128.
_EXPONENT_OFFSET = 160
_EXPONENT_BINS = 300


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if is_dtensor(grad) else grad


def gradient_range(grads: Iterable[torch.Tensor], dtype: torch.dtype, loss_scale: float, device: torch.device,
                   group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """How the gradients (multiplied by ``loss_scale``) fall in ``dtype``'s range, summed over
    the ranks of ``group`` (module docstring). Counted on ``device``, where NCCL can sum them."""
    tiny = torch.finfo(dtype).tiny  # the smallest normal value
    # values, zero in fp32, zero or subnormal in dtype as held, and as held ÷ loss_scale.
    counts = torch.zeros(4, dtype=torch.float64, device=device)
    exponents = torch.zeros(_EXPONENT_BINS, dtype=torch.float64, device=device)
    for grad in grads:
        g = _local(grad).detach().float().flatten()
        counts += torch.stack([torch.tensor(g.numel(), device=device), (g == 0).sum(),
                               (g.to(dtype).abs() < tiny).sum(), ((g / loss_scale).to(dtype).abs() < tiny).sum()])
        _, exponent = torch.frexp(g[g != 0])
        exponents += torch.bincount(exponent.flatten().int() + _EXPONENT_OFFSET, minlength=_EXPONENT_BINS)
    if dist.is_initialized():
        both = torch.cat([counts, exponents])
        dist.all_reduce(both, group=group)
        counts, exponents = both[:4], both[4:]
    values, zero_fp32, low_held, low_unscaled = (int(c) for c in counts.tolist())
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "loss_scale": loss_scale,
        "values": values,
        "zero_in_fp32": zero_fp32,
        "zero_or_subnormal": low_held,
        "zero_or_subnormal_unscaled": low_unscaled,
        "fraction_zero_or_subnormal": low_held / values if values else None,
        "fraction_zero_or_subnormal_unscaled": low_unscaled / values if values else None,
        # [k, count]: the values with |g| in [2^k, 2^(k+1)) as held (with the loss scale);
        # frexp's exponent is k + 1.
        "log2_histogram": [[e - _EXPONENT_OFFSET - 1, int(n)] for e, n in enumerate(exponents.tolist()) if n],
    }


class NumericsLog:
    """The per-step loss scale, skipped steps and gradient norms of one cell's run."""

    def __init__(self, steps: int, scaler: torch.amp.GradScaler, initial_skipped: int = 0):
        self._scaler = scaler
        self._previous_scale = scaler.get_scale() if scaler.is_enabled() else None
        self._skipped_before = initial_skipped
        self.loss_scale: list[float | None] = [None] * steps
        self.skipped_steps: list[int] = []
        self.grad_norm: list[float | None] = [None] * steps

    def after_harness_step(self, i: int) -> None:
        """After step ``i`` of a step the harness drives (GradScaler's scale, read outside any
        timed region: on CUDA reading it waits for the device)."""
        if not self._scaler.is_enabled():
            return
        scale = self._scaler.get_scale()
        if self._previous_scale is not None and scale < self._previous_scale:
            self.skipped_steps.append(i)
        self.loss_scale[i] = self._previous_scale = scale

    def after_engine_step(self, i: int, scale: float | None, skipped_so_far: int, grad_norm: float | None) -> None:
        """After step ``i`` of an engine that owns its step (DeepSpeed): what it reports."""
        self.loss_scale[i] = scale
        if skipped_so_far > self._skipped_before:
            self.skipped_steps.append(i)
        self._skipped_before = skipped_so_far
        self.grad_norm[i] = _finite_or_none(grad_norm)

    def set_grad_norms(self, norms: list[float]) -> None:
        """The norms the harness's steps measured (NaN where a step did not measure one)."""
        for i, norm in enumerate(norms):
            if not math.isnan(norm):
                self.grad_norm[i] = _finite_or_none(norm)

    def to_record(self, gradient_range: dict[str, Any] | None, range_reason: str) -> dict[str, Any]:
        return {"loss_scale": self.loss_scale, "skipped_steps": self.skipped_steps, "grad_norm": self.grad_norm,
                "gradient_range": gradient_range, "gradient_range_reason": range_reason}


def _finite_or_none(value: float | None) -> float | None:
    """JSON has no inf or NaN: an overflowed norm is written as null (its step is skipped)."""
    return value if value is not None and math.isfinite(value) else None
