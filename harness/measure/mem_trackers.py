"""torch's memory trackers (torch.distributed._tools) as measure/memory.py runs them: MemTracker
with both changes below, or for FSDP2 FSDPMemTracker with the second.

- A module forwarded again at the top level within one step (a pipeline stage, once per
  micro-batch) starts its per-module statistics again, where torch's MemTracker raises "does
  not support memory tracking for multiple iterative calls". The step's peak is untouched.
- The per-module peaks are updated after every op by a copy of torch 2.13's
  ``_update_peak_stats`` that gives the same numbers faster. torch's walks every module it
  has seen through its WeakIdKeyDictionary's ``values()``, whose check of each weak reference
  asks ``hasattr(module, "_fix_weakref")``, an AttributeError raised through
  ``nn.Module.__getattr__`` for every module at every op, and copies each new peak's snapshot
  (a flat dict of ints) with ``deepcopy``. That was a quarter of a memory-tracked step here:
  the traced predictor's 40 tiny cells of the default suite took 55.3 s against 63.1 s, every
  result the same to the byte. The copy is used only where the installed torch's method is
  the one it copies (``_QUICK_FOR``, its source text): a torch that changed it, or ships no
  source to compare, keeps its own.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # imported where used: torch.distributed._tools loads on the first tracked step
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

# The sha256 of torch's MemTracker._update_peak_stats source (torch 2.13) that
# _tracker_classes' QuickPeakStats._update_peak_stats reproduces.
_QUICK_FOR = "19ad36727caf6fd285848117e489f7c4fb711d938e6c93221fb2266f2c33bd93"


def make_tracker(module: nn.Module, optimizer: torch.optim.Optimizer | None, fsdp2: bool,
                 held: Sequence[torch.Tensor]) -> tuple[MemTracker, str]:
    """A tracker of ``module``, ``optimizer`` and the ``held`` tensors, and its name as the
    record gives it ("MemTracker" | "FSDPMemTracker")."""
    repeated_forward, fsdp = _tracker_classes()
    if fsdp2:
        fsdp_tracker = fsdp(module, optimizer)
        fsdp_tracker.track_external(*held)
        return fsdp_tracker, "FSDPMemTracker"
    from torch.distributed.optim import ZeroRedundancyOptimizer

    tracker = repeated_forward()
    # ZeroRedundancyOptimizer keeps the real (sharded) state in its local optimizer.
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim
    tracker.track_external(module, optimizer, *held)  # type: ignore[arg-type]  # None is skipped; torch's annotation omits it
    return tracker, "MemTracker"


def quick_peak_stats_in_use() -> bool:
    """Whether the installed torch's ``_update_peak_stats`` is the one the quick copy reproduces."""
    from torch.distributed._tools.mem_tracker import MemTracker

    try:
        return _source_digest(MemTracker._update_peak_stats) == _QUICK_FOR
    except OSError:  # a torch installed without its .py files: nothing to compare
        return False


def _source_digest(function: Any) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


@functools.cache
def _tracker_classes() -> tuple[type[MemTracker], type[FSDPMemTracker]]:
    """(the MemTracker for any model, the FSDPMemTracker for FSDP2's), each with the quick
    peak statistics where they apply (module docstring)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _State

    class QuickPeakStats(MemTracker):
        def _update_peak_stats(self, peak_state: _State) -> None:
            # torch's, line for line, with the modules' stats read from a copy of the
            # dictionary's own dict (a dead module's entry leaves it as the module dies, which
            # a collection inside the loop could bring about) and the snapshots copied as the
            # flat dicts of ints they are.
            curr_snap = self._curr_mem_snap
            parents = self._mod_tracker.parents
            for mod_stats in tuple(self.memory_tracking.data.values()):
                if mod_stats.mod_fqn in parents and peak_state in mod_stats.snapshots:
                    for dev, dev_snap in curr_snap.items():
                        if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                            mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                            mod_stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
            for dev, dev_snap in curr_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(dev_snap)

    quick = quick_peak_stats_in_use()

    def with_quick_stats(tracker: type[MemTracker]) -> tuple[type[MemTracker], ...]:
        """The bases of ``tracker`` with the quick peak statistics, where they reproduce its own."""
        same = quick and tracker._update_peak_stats is MemTracker._update_peak_stats
        return (QuickPeakStats, tracker) if same else (tracker,)

    class RepeatedForwardMemTracker(*with_quick_stats(MemTracker)):  # type: ignore[misc]
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    class QuickFSDPMemTracker(*with_quick_stats(FSDPMemTracker)):  # type: ignore[misc]
        pass

    return RepeatedForwardMemTracker, QuickFSDPMemTracker
