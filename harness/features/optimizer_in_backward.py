"""The optimizer applied in backward: each parameter is updated as soon as its gradient is
accumulated, and its gradient freed then, so a step never holds every gradient at once
(PyTorch's recipe "How to save memory by fusing the optimizer step into the backward pass":
``Tensor.register_post_accumulate_grad_hook``).

One optimizer over every parameter, stepped in each parameter's hook: a torch optimizer steps
only the parameters that have a gradient, and when a parameter's hook runs no other has one
(each earlier one was stepped and freed in its own hook, the later ones are not computed
yet), so each call updates that parameter alone, by the same per-tensor arithmetic as one
step over all of them. What the training loop steps is ``StepsInBackward``: nothing is left
to do by then. It cannot go with gradient accumulation (the hook runs at every micro-step's
accumulation), clipping or a global gradient norm (no moment holds every gradient), nor a
GradScaler (the update happens before the loop could unscale or skip it).

DDP has torch's own integration (``torch.distributed.optim._apply_optimizer_in_backward``,
whose DDP comm hook steps each bucket's parameters after its all-reduce); on the CPU it fails
at the end of backward in ``torch.accelerator.current_stream()`` ("Cannot access accelerator
device when none is available"), which ``ON_CPU`` quotes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

ON_CPU = ("DDP's optimizer in backward (torch's _apply_optimizer_in_backward with DDP's comm hook) waits for its"
          " optimizer stream with torch.accelerator.current_stream(), which fails on the CPU: \"Cannot access"
          " accelerator device when none is available\"")


class StepsInBackward(torch.optim.Optimizer):
    """The loop's optimizer when the parameters were stepped in backward: ``step`` and
    ``zero_grad`` have nothing left to do. Its ``param_groups`` and ``state`` are the real
    optimizer's (what the memory tracker and the loss scaler read)."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        # Not Optimizer.__init__: that would make a second set of groups and state.
        self.inner = inner
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups
        self.state = inner.state

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def in_backward(params: Iterable[nn.Parameter], make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                ) -> tuple[StepsInBackward, torch.optim.Optimizer]:
    """The loop's optimizer and the real one, each parameter stepped in its own hook."""
    params = [p for p in params if p.requires_grad]
    optimizer = make(params)

    def step_now(param: Any) -> None:
        optimizer.step()
        param.grad = None

    for p in params:
        p.register_post_accumulate_grad_hook(step_now)
    return StepsInBackward(optimizer), optimizer
