"""Peak memory of one training step, per rank.

Use one ``with`` block around exactly one full step (forward, backward, optimizer.step,
zero_grad)::

    with track_step_memory(model, opt, fsdp2=is_fsdp2, device=device) as probe:
        step(between_micro_steps=probe.micro_step_boundary)
    mem = probe.result()

The trackers refuse a second forward of the same module in one block; with gradient
accumulation, call ``probe.micro_step_boundary()`` between micro-steps (it clears the
per-module statistics, not the step's peak).

Measure a step at or after the third: DDP rebuilds its buckets during the first steps and
the optimizer creates its state on the first ``step()``; choosing that step is the caller's
job.

``device`` is where the step computes, which decides CPU vs CUDA below; it is not inferred
from the parameters, since FSDP2 with CPUOffloadPolicy keeps the sharded parameters on the
CPU while computing on CUDA.

Where the numbers come from
- CPU (``device.type != "cuda"``): ``torch.distributed._tools.mem_tracker.MemTracker`` (or ``FSDPMemTracker`` for FSDP2
  ``fully_shard`` models), a TorchDispatchMode that sees every tensor storage created in the
  step plus the module's and optimizer's existing tensors. ``peak_bytes`` is its peak "Total"
  and ``breakdown_bytes`` the same peak snapshot by category, so they sum exactly.
  ``rss_peak_bytes`` is the process VmHWM after resetting it (/proc/self/clear_refs "5");
  it is dominated by the libraries (~300 MB), so compare it across cells, not to tensors.
- CUDA: ``peak_bytes`` is ``torch.cuda.max_memory_allocated(device)``. Before the step the
  device is synchronised and both its peak and its accumulated allocator statistics are reset
  (``reset_peak_memory_stats`` and ``reset_accumulated_memory_stats``), so every number in
  ``cuda`` is for this step alone: ``max_allocated``, ``max_reserved``, ``fragmentation``
  (max_reserved - max_allocated), ``alloc_retries`` (``num_alloc_retries``) and ``num_ooms``;
  the device is synchronised again after the step. The breakdown still comes from the same
  trackers, their snapshot for ``device`` (the trackers round CUDA storages to the
  allocator's 512-byte blocks);
  whatever the allocator held at its peak that the tracker did not see (tensors from before
  the step that were not registered, library workspaces) is added to "other", so the
  breakdown still sums to ``peak_bytes``. The two peaks can fall at slightly different
  moments; the tracker's snapshot is the one reported.

Category mapping (tracker category -> breakdown key)
- MemTracker: Parameter -> params; Gradient -> grads; Optstate -> optimizer (includes the
  optimizer's step counters and, if the peak falls inside ``optimizer.step``, its temporaries:
  foreach AdamW allocates parameter-sized scratch there, fused AdamW does not);
  Activation -> activations (tensors made in forward, including the loss); Temp (tensors
  made in backward: activation gradients, grads before accumulation), Buffer, Other -> other.
- FSDPMemTracker: Sharded Param, Unsharded Param -> params; Sharded Grad, Unsharded Grad ->
  grads; OptState -> optimizer; Activation -> activations; Temp, All Gather (all-gather output
  buffers), Reduce Scatter (reduce-scatter input buffers), Buffer, Inputs -> other.

Wrappers
- DDP (DistributedDataParallel) is an ordinary nn.Module and is tracked directly. Its flat
  gradient bucket (one gradient-sized buffer, seen as the all-reduce's output) lands in
  "other": 2 ranks, 49,792 parameter bytes -> other 49,792.
- ZeroRedundancyOptimizer: its own ``state`` only holds what was consolidated; the real
  (sharded) state lives in the local optimizer ``opt.optim``, so that is what is registered.
- Engines' own tensors made before the step (DeepSpeed's fp32 master partitions and ZeRO-3
  parameter partitions) are invisible unless passed as ``held``; they count as "other".
- DeepSpeed: ``track_external`` refuses its ZeRO optimizer wrappers ("not supported for
  tracking"); pass ``engine.module`` and the wrapped torch optimizer ``opt.optimizer``.
- FSDP1 (FullyShardedDataParallel, device_id=cpu) is tracked as an nn.Module by MemTracker:
  its flat parameters (sharded and, while gathered, unsharded) count as params; it assigns
  the sharded gradient to ``flat_param.grad`` itself, so MemTracker never labels gradients
  and they land in "other" (grads is 0). FSDPMemTracker only understands FSDP2.

Frees on another thread
A tensor whose last reference is dropped on a thread other than the step's is freed at a
moment the scheduler picks: gloo's worker threads drop a finished collective's buffers (FSDP2's
all-gather outputs), and a comm hook's ``Future.then`` callbacks run there (PowerSGD's
bucket-sized buffers). When such a free comes late, the buffer overlaps the step's next
allocations and the peak is higher by up to its size: 4 of 56 steady PowerSGD steps (+402,944 B)
on a loaded 2-core host, and 1 of 62 fp32 cells (3.0 KiB) over three rounds of the default suite.
``async_freed_bytes`` counts the bytes freed that way during the step: how far the peak can
move from run to run. A cell without any has a peak that does not move.

No references to the module, optimizer or their tensors outlive the ``with`` block: the
result is computed when the block exits and the tracker is dropped then.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

BREAKDOWN_KEYS = ("params", "grads", "optimizer", "activations", "other")

# Tracker category names (the enums are str-valued) -> breakdown key; anything else -> other.
_CATEGORY = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Unsharded Param": "params",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
}

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


@dataclass(frozen=True, kw_only=True)
class StepMemory:
    peak_bytes: int
    breakdown_bytes: dict[str, int]
    rss_peak_bytes: int | None
    cuda: dict[str, int] | None
    tracker: str  # "MemTracker" | "FSDPMemTracker" | "cuda"
    # What was held, by category, at the moment the optimizer step began (every gradient
    # reduced, activations freed): the model states the ZeRO formulas describe. None when
    # the step never called ``probe.before_optimizer_step()``.
    at_optimizer_step_bytes: dict[str, int] | None = None
    # Bytes freed during the step on another thread (module docstring): the peak's play.
    async_freed_bytes: int = 0


def _reset_rss_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:  # not Linux, or /proc not writable in this container
        return False


def _rss_peak() -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError("VmHWM missing from /proc/self/status")


def _make_tracker(module: nn.Module, optimizer: torch.optim.Optimizer | None, fsdp2: bool,
                  held: Sequence[torch.Tensor]):
    from torch.distributed._tools.mem_tracker import MemTracker

    if fsdp2:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(module, optimizer)
        tracker.track_external(*held)
        return tracker, "FSDPMemTracker"
    from torch.distributed.optim import ZeroRedundancyOptimizer

    tracker = MemTracker()
    # ZeroRedundancyOptimizer keeps the real (sharded) state in its local optimizer.
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim
    tracker.track_external(module, optimizer, *held)
    return tracker, "MemTracker"


def _breakdown(snapshot: dict) -> dict[str, int]:
    out = dict.fromkeys(BREAKDOWN_KEYS, 0)
    for category, nbytes in snapshot.items():
        if category != "Total":
            out[_CATEGORY.get(str(getattr(category, "value", category)), "other")] += nbytes
    if sum(out.values()) != snapshot["Total"]:
        raise AssertionError(f"tracker categories do not sum to its Total: {snapshot}")
    return out


def _cuda_stats(device: torch.device) -> dict[str, int]:
    """The step's allocator numbers for `device` (its stats were reset before the step)."""
    stats = torch.cuda.memory_stats(device)
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    return {
        "max_allocated": allocated,
        "max_reserved": reserved,
        "fragmentation": reserved - allocated,
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "num_ooms": stats.get("num_ooms", 0),
    }


class _AsyncFrees:
    """Counts the bytes the tracker sees freed on a thread other than the one it was made on,
    while ``counting``. The tracker's weakref callback (``_delete_callback``, looked up on the
    instance as each storage is first seen) is the one place every free passes through."""

    def __init__(self, tracker) -> None:
        self.bytes = 0
        self.counting = False
        self._thread = threading.get_ident()
        tracker_callback = tracker._delete_callback

        def delete_callback(winfo, w_st) -> None:
            if self.counting and threading.get_ident() != self._thread:
                self.bytes += winfo.mem_consumed
            tracker_callback(winfo, w_st)

        tracker._delete_callback = delete_callback


class MemoryProbe:
    """What ``track_step_memory`` yields: a hook for accumulation boundaries, and the result."""

    def __init__(self, tracker, device: torch.device) -> None:
        self._tracker = tracker
        self._device = device
        self._result: StepMemory | None = None
        self._at_optimizer_step: dict[str, int] | None = None

    def micro_step_boundary(self) -> None:
        self._tracker.reset_mod_stats()

    def before_optimizer_step(self) -> None:
        """Call after the last backward of the step, before the optimizer (or the engine)
        steps: records what is held right then, by category."""
        # Buffers of finished collectives can linger in reference cycles (gloo's works);
        # collect them first, so the snapshot holds what the step keeps, not what awaits the GC.
        gc.collect()
        current = self._tracker.get_tracker_snapshot("current")
        self._at_optimizer_step = _breakdown(current.get(self._device, {"Total": 0}))

    def result(self) -> StepMemory:
        if self._result is None:
            raise RuntimeError("the memory of a step is known only after its `with` block")
        return self._result


@contextmanager
def track_step_memory(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, *, fsdp2: bool,
    device: torch.device, held: Sequence[torch.Tensor] = (),
) -> Iterator[MemoryProbe]:
    """Track one training step computed on `device`; ``probe.result()`` gives its StepMemory.

    ``held``: tensors an engine made before the step and keeps outside the module's
    parameters and the optimizer's state (DeepSpeed's fp32 master partitions, ZeRO-3's
    parameter partitions); the tracker cannot see them otherwise. Counted as "other".

    CPU vs CUDA follows `device`, not where the parameters live. A bare "cuda" means the
    current CUDA device (the trackers key their snapshots by an indexed device).
    """
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    if on_cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tracker, name = _make_tracker(module, optimizer, fsdp2, held)
    async_frees = _AsyncFrees(tracker)
    probe = MemoryProbe(tracker, device)
    rss_ok = _reset_rss_peak()
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
    async_frees.counting = True
    with tracker:
        yield probe
    async_frees.counting = False
    rss = _rss_peak() if rss_ok else None
    peaks = tracker.get_tracker_snapshot("peak")
    at_optimizer_step = probe._at_optimizer_step
    # The tracker sits in reference cycles (its weakref callbacks point back at it) that
    # keep the model's parameters alive until a collection after the model is dropped;
    # collecting here, while the model is still alive, lets the caller free it by refcount.
    del tracker, probe._tracker
    gc.collect()

    if on_cuda:
        torch.cuda.synchronize(device)
        cuda = _cuda_stats(device)
        breakdown = _breakdown(peaks.get(device, {"Total": 0}))
        untracked = cuda["max_allocated"] - sum(breakdown.values())
        if untracked < 0:
            raise AssertionError(f"tracker saw more than the allocator: {breakdown} vs {cuda}")
        breakdown["other"] += untracked
        probe._result = StepMemory(peak_bytes=cuda["max_allocated"], breakdown_bytes=breakdown,
                                   rss_peak_bytes=rss, cuda=cuda, tracker="cuda",
                                   at_optimizer_step_bytes=at_optimizer_step, async_freed_bytes=async_frees.bytes)
    else:
        breakdown = _breakdown(peaks.get(torch.device("cpu"), {"Total": 0}))
        probe._result = StepMemory(peak_bytes=sum(breakdown.values()), breakdown_bytes=breakdown,
                                   rss_peak_bytes=rss, cuda=None, tracker=name,
                                   at_optimizer_step_bytes=at_optimizer_step, async_freed_bytes=async_frees.bytes)
