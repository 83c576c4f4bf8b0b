"""Peak memory of one training step, per rank.

Use one ``with`` block around exactly one full step (forward, backward, optimizer.step,
zero_grad)::

    with track_step_memory(model, opt, fsdp2=is_fsdp2, device=device) as probe:
        step(between_micro_steps=probe.micro_step_boundary)
    mem = probe.result()

torch's trackers refuse a second forward of the same module in one block; with gradient
accumulation, call ``probe.micro_step_boundary()`` between micro-steps (it clears the
per-module statistics, not the step's peak). A pipeline schedule forwards each stage once
per micro-batch with backwards in between, inside the harness's one call: the MemTracker used
here (measure/mem_trackers.py) forgets a top-level module's statistics when it is forwarded
again (the step's peak, which is all this module reads, is left alone).

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
  the device is synchronised again after the step. ``allocated`` and ``reserved`` are the
  allocator's holdings when the step ended, ``nvml_used`` what NVML reports used on the whole
  device then (every process and the CUDA context, via ``torch.cuda.device_memory_used``;
  None with ``nvml_reason`` when nvidia-ml-py or the driver's NVML is missing). The breakdown still comes from the same
  trackers, their snapshot for ``device`` (the trackers round CUDA storages to the
  allocator's 512-byte blocks);
  whatever the allocator held at its peak that the tracker did not see (tensors from before
  the step that were not registered, library workspaces) is added to "other", so the
  breakdown still sums to ``peak_bytes``. The two peaks can fall at slightly different
  moments; the tracker's snapshot is the one reported.

Per module (``StepMemory.modules``): for each top-level module of the model (every repeated
block, and the modules beside the blocks' containers: embeddings, final norm, head), what was
held, by category, at the highest point while it ran forward and while it ran backward (the
trackers' per-module peak snapshots, pytorch_memlab's view), and its parameters' bytes. With
accumulation or a pipeline the last micro-batch's (the trackers start a module's statistics
again when it is forwarded again).

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
- Engines' own tensors made before the step (DeepSpeed's fp32 master partitions, ZeRO-3
  parameter partitions and its flat gradient buffer) are invisible unless passed as
  ``held``; they count as "other". DDP's buckets are made in C++ and reachable from no
  Python object: they are taken from the all-reduces of the step before
  (``all_reduced_buffers``) and passed as ``held``, or the tracker would see each only from
  its first all-reduce on, and a DDP peak at the start of backward would miss them.
- DeepSpeed: ``track_external`` refuses its ZeRO optimizer wrappers ("not supported for
  tracking"); pass ``engine.module`` and the wrapped torch optimizer ``opt.optimizer``.
- FSDP1 (FullyShardedDataParallel, device_id=cpu) is tracked as an nn.Module by MemTracker:
  its flat parameters (sharded and, while gathered, unsharded) count as params; it assigns
  the sharded gradient to ``flat_param.grad`` itself, so MemTracker never labels gradients
  and they land in "other" (grads is 0). FSDPMemTracker only understands FSDP2.

Frees and allocations on another thread: on the CPU the tracked step pauses
``RELEASE_PAUSE_S`` after every wait on a c10d ``Work``, and comm hooks' callbacks run
untracked (measure/futures.py), so that the peak does not depend on which thread frees or
allocates; README "What is measured" has the measurements behind both.

Timeline (``timeline=True``)
Every change the tracker makes to its current bytes, in order: ``[seconds since the step
began, breakdown key, signed bytes]``; the running sum per key is memory over time by
category, the same on CPU and CUDA. The tracker samples its peak after each op, while the
timeline also sees what lives between two ops, so its maximum can be above ``peak_bytes``
(a 2-layer MLP's step: +13 %). A storage whose category changes (an activation that
becomes a gradient) appears as a minus on one key and a plus on the other. At most
``TIMELINE_MAX_EVENTS`` are kept (``timeline_truncated`` says so): a big model's step makes
hundreds of thousands.

Memory between steps (``live_bytes``, for the leak check)
- CUDA: ``torch.cuda.memory_allocated``: every tensor byte the allocator has handed out.
- CPU: the bytes of the distinct storages of every CPU tensor the garbage collector tracks
  (every tensor Python holds, directly or in containers: a list that keeps a tensor per step
  shows in full). Tensors only C++ holds (DDP's buckets, gloo's buffers) are not seen; they
  do not grow from step to step unless the library leaks. Not glibc's malloc count: that
  moves by ±300 KB over five gpt2-tiny steps on 2 gloo ranks (ZeRO-1 +300 KB, FSDP −100 KB)
  with nothing kept. Objects in gc's permanent generation are not walked: the worker freezes
  what is alive before each cell (runner/worker.py), so only what the cell made is counted,
  in a few milliseconds; the growth is a difference, which what came before cannot change.

No references to the module, optimizer or their tensors outlive the ``with`` block: the
result is computed when the block exits and the tracker is dropped then.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from harness.measure import futures, mem_trackers

if TYPE_CHECKING:  # imported where used: torch.distributed._tools loads on the first tracked step
    from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType, _WeakRefInfo
    from torch.distributed.distributed_c10d import Work

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

TIMELINE_MAX_EVENTS = 200_000
# After each c10d wait in a CPU memory step: time for gloo's worker to drop the collective's
# tensors (module docstring, "Frees and allocations on another thread").
RELEASE_PAUSE_S = 0.001
# CPU live_bytes: walks of the heap, the least taken (live_bytes).
LIVE_BYTES_WALKS = 3
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


class CudaStats(TypedDict):
    """The step's CUDA allocator numbers (module docstring, "Where the numbers come from")."""

    max_allocated: int
    max_reserved: int
    fragmentation: int
    alloc_retries: int
    num_ooms: int
    allocated: int
    reserved: int
    nvml_used: int | None
    nvml_reason: str


# One tracker event: [seconds since the step began, breakdown key, signed bytes].
TimelineEvent = list[float | str]


@dataclass(frozen=True, kw_only=True)
class StepMemory:
    peak_bytes: int
    breakdown_bytes: dict[str, int]
    rss_peak_bytes: int | None
    cuda: CudaStats | None
    tracker: str  # "MemTracker" | "FSDPMemTracker" | "cuda"
    # What was held, by category, at the moment the optimizer step began (every gradient
    # reduced, activations freed): the model states the ZeRO formulas describe. None when
    # the step never called ``probe.before_optimizer_step()``.
    at_optimizer_step_bytes: dict[str, int] | None = None
    # Bytes freed during the step on another thread (module docstring): the peak's play.
    async_freed_bytes: int = 0
    # The step's tracker events (module docstring, "Timeline"); None unless asked for.
    timeline: list[TimelineEvent] | None = None
    timeline_truncated: bool = False
    # Each top-level module's peaks (module docstring, "Per module"); empty without blocks.
    modules: list[dict[str, Any]] = field(default_factory=list)


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


def _breakdown(snapshot: dict[str, int]) -> dict[str, int]:
    out = dict.fromkeys(BREAKDOWN_KEYS, 0)
    for category, nbytes in snapshot.items():
        if category != "Total":
            out[_CATEGORY.get(str(getattr(category, "value", category)), "other")] += nbytes
    if sum(out.values()) != snapshot["Total"]:
        raise AssertionError(f"tracker categories do not sum to its Total: {snapshot}")
    return out


def nvml_used(device: torch.device) -> tuple[int | None, str]:
    """(bytes NVML reports used on the whole device, "") or (None, why it cannot say)."""
    try:
        return torch.cuda.device_memory_used(device), ""
    except ModuleNotFoundError:
        return None, "nvidia-ml-py (pynvml) is not installed"
    except Exception as error:  # pynvml.NVMLError and the driver's: NVML absent in a container
        return None, f"NVML: {type(error).__name__}: {error}"


def _cuda_stats(device: torch.device) -> CudaStats:
    """The step's allocator numbers for `device` (its stats were reset before the step)."""
    stats = torch.cuda.memory_stats(device)
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    used, nvml_reason = nvml_used(device)
    return {
        "max_allocated": allocated,
        "max_reserved": reserved,
        "fragmentation": reserved - allocated,
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "num_ooms": stats.get("num_ooms", 0),
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "nvml_used": used,
        "nvml_reason": nvml_reason,
    }


# Allocator history entries kept for a CUDA memory snapshot: a step of a 1B model makes
# tens of thousands; beyond this the oldest are overwritten (a ring buffer).
HISTORY_MAX_ENTRIES = 500_000


@contextmanager
def cuda_memory_history(pickle_path: Path) -> Iterator[None]:
    """Record the CUDA caching allocator's history for the block and write its snapshot to
    ``pickle_path`` in PyTorch's own format (``_dump_snapshot``: a pickle, the file
    pytorch.org/memory_viz opens; nothing in shardbench loads it). Python frames only: C++
    frames are symbolised when the snapshot is taken, which can take minutes."""
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_MAX_ENTRIES, stacks="python")
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(str(pickle_path))
        torch.cuda.memory._record_memory_history(enabled=None)


def _python_tensor_bytes() -> int:
    """Bytes of the distinct storages of every CPU tensor the garbage collector tracks (not
    those in its permanent generation: ``gc.freeze``), and of the tensors the autograd graphs
    behind them still save: a graph kept alive (a loss held with ``retain_graph``, an output
    a hook keeps) holds its activations in C++, where the collector does not look."""
    seen: set[int] = set()
    graphs: list[Any] = []
    total = 0

    def count(tensor: torch.Tensor) -> int:
        try:
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses (DTensor) own no storage;
            return 0  # FSDP2 frees an unsharded parameter's by resizing it away
        if address in seen:
            return 0
        seen.add(address)
        return storage.nbytes()

    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some module proxies
        # answer with a deprecation warning.
        if not issubclass(type(obj), torch.Tensor) or obj.device.type != "cpu":
            continue
        total += count(obj)
        try:
            grad_fn = obj.grad_fn
        except RuntimeError:  # a view whose base was modified in place (FSDP1's flat parameter's views)
            continue
        if grad_fn is not None:
            graphs.append(grad_fn)
    for saved in _saved_tensors(graphs):
        if saved.device.type == "cpu":
            total += count(saved)
    return total


def _saved_tensors(roots: list[Any]) -> Iterator[torch.Tensor]:
    """The tensors the autograd nodes reachable from ``roots`` still save (a node's
    ``_saved_*`` attributes; a graph whose backward ran without retain_graph has freed them,
    and reading one raises)."""
    visited: set[int] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed by a backward
                continue
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, torch.Tensor):
                    yield item
        stack.extend(next_node for next_node, _ in node.next_functions)


def live_bytes(device: torch.device) -> int:
    """Memory held right now (module docstring, "Memory between steps")."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    # The least of a few walks RELEASE_PAUSE_S apart: gloo's worker thread can still hold a
    # finished collective's tensors for a moment (PowerSGD's bucket on gpt2-tiny, 0.5 MB, in
    # one run of three), which the step no longer holds; a leak stays in every walk.
    least = _python_tensor_bytes()
    for _ in range(LIVE_BYTES_WALKS - 1):
        time.sleep(RELEASE_PAUSE_S)
        least = min(least, _python_tensor_bytes())
    return least


class _Timeline:
    """Records every change the tracker makes to ``device``'s current bytes, as
    [seconds, breakdown key, signed bytes]; ``_update_snap`` is where every one passes."""

    def __init__(self, tracker: MemTracker, device: torch.device) -> None:
        self.events: list[TimelineEvent] = []
        self.truncated = False
        self._start = time.perf_counter()
        update_snap = tracker._update_snap
        snapshots = tracker._curr_mem_snap
        # What the tracker registered before this (the module and optimizer, at construction).
        self._record({}, snapshots.get(device, {}))

        def recording_update_snap(u_type: _UpdateType, winfo: _WeakRefInfo, *args: Any, **kwargs: Any) -> None:
            if winfo.device != device:
                update_snap(u_type, winfo, *args, **kwargs)
                return
            before = dict(snapshots.get(device, {}))
            update_snap(u_type, winfo, *args, **kwargs)
            self._record(before, snapshots.get(device, {}))

        # The instance attribute shadows the method: every update comes through here.
        tracker._update_snap = recording_update_snap  # type: ignore[method-assign]

    def _record(self, before: dict[str, int], after: dict[str, int]) -> None:
        at = round(time.perf_counter() - self._start, 6)
        for category in set(before) | set(after):
            delta = after.get(category, 0) - before.get(category, 0)
            if delta and category != "Total":
                if len(self.events) >= TIMELINE_MAX_EVENTS:
                    self.truncated = True
                    return
                key = _CATEGORY.get(str(getattr(category, "value", category)), "other")
                self.events.append([at, key, delta])


class _AsyncFrees:
    """Counts the bytes the tracker sees freed on a thread other than the one it was made on,
    while ``counting``. The tracker's weakref callback (``_delete_callback``, looked up on the
    instance as each storage is first seen) is the one place every free passes through."""

    def __init__(self, tracker: MemTracker) -> None:
        self.bytes = 0
        self.counting = False
        self._thread = threading.get_ident()
        tracker_callback = tracker._delete_callback

        def delete_callback(winfo: _WeakRefInfo, w_st: weakref.ref[torch.UntypedStorage]) -> None:
            if self.counting and threading.get_ident() != self._thread:
                self.bytes += winfo.mem_consumed
            tracker_callback(winfo, w_st)

        # The instance attribute shadows the method (looked up on the instance, as above).
        tracker._delete_callback = delete_callback  # type: ignore[method-assign]


class _AllReduceInputs(TorchDispatchMode):
    """The tensors handed to every all-reduce that backward issues in the block, in order (a
    gradient norm's, an optimizer's, reduced after backward, are the step's own temporaries)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.tensors: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        # -1 outside backward (the autograd engine's current graph task).
        if func is torch.ops.c10d.allreduce_.default and torch._C._current_graph_task_id() != -1:
            self.tensors.extend(args[0])
        return func(*args, **(kwargs or {}))


@contextmanager
def all_reduced_buffers() -> Iterator[list[torch.Tensor]]:
    """The tensors the block's backward all-reduces, each storage once, filled as the block
    ends: run around a step before the memory step of an engine whose backward all-reduces
    buffers it keeps from step to step (DDP's gradient buckets, made in C++ when DDP is built, which the
    tracker would otherwise see only from their first all-reduce: module docstring,
    "Wrappers"), and pass them to ``track_step_memory`` as ``held``."""
    buffers: list[torch.Tensor] = []
    with _AllReduceInputs() as mode:
        yield buffers
    seen: set[int] = set()
    for tensor in mode.tensors:
        key = tensor.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            buffers.append(tensor)


@contextmanager
def _pause_after_waits(pause_s: float) -> Iterator[None]:
    """Every ``Work.wait`` in the block returns ``pause_s`` after the collective completed."""
    from torch.distributed.distributed_c10d import Work

    original_wait = Work.__dict__["wait"]

    def wait(self: Work, *args: Any, **kwargs: Any) -> bool:
        completed: bool = original_wait(self, *args, **kwargs)
        time.sleep(pause_s)
        return completed

    Work.wait = wait  # type: ignore[method-assign]  # patched for the block, restored below
    try:
        yield
    finally:
        Work.wait = original_wait  # type: ignore[method-assign]


def _untracked() -> AbstractContextManager[None]:
    """This thread's dispatch modes less the memory tracker's (every tracker here is a
    MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return futures.without_modes_of(MemTracker)


class MemoryProbe:
    """What ``track_step_memory`` yields: a hook for accumulation boundaries, and the result."""

    def __init__(self, tracker: MemTracker, device: torch.device) -> None:
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


def top_level_modules(root: nn.Module, block_type: type[nn.Module]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every repeated block and of each module beside the blocks'
    containers (a child of the root or of a container holding blocks, itself holding none)."""
    names = dict(root.named_modules())
    holds_blocks = {name for name, m in names.items()
                    if any(isinstance(sub, block_type) for sub in m.modules()) and not isinstance(m, block_type)}
    chosen = []
    for name, m in names.items():
        parent = name.rpartition(".")[0] if name else None
        if isinstance(m, block_type) or (name and name not in holds_blocks and parent in holds_blocks
                                         and not any(isinstance(a, block_type) for a in _ancestors(names, name))):
            chosen.append((name, m))
    return chosen


def _ancestors(names: dict[str, nn.Module], name: str) -> list[nn.Module]:
    parts = name.split(".")
    return [names[".".join(parts[:i])] for i in range(1, len(parts))]


def _module_peaks(tracker: Any, root: nn.Module, block_type: type[nn.Module],
                  device: torch.device) -> list[dict[str, Any]]:
    """The per-module peaks (module docstring, "Per module")."""
    from torch.distributed._tools.mem_tracker import _ModState

    key = torch.device("cpu") if device.type != "cuda" else device
    out = []
    for name, module in top_level_modules(root, block_type):
        stats = tracker.memory_tracking.get(module)
        if stats is None:  # not run in this step (a pipeline stage's other layers)
            continue
        entry: dict[str, Any] = {"module": name, "params_bytes": sum(p.numel() * p.element_size()
                                                                     for p in module.parameters())}
        for label, state in (("forward", _ModState.PEAK_FW), ("backward", _ModState.PEAK_BW)):
            snaps = stats.snapshots.get(state) or []
            snap = snaps[-1].get(key) if snaps else None
            entry[f"peak_{label}_bytes"] = _breakdown(snap) if snap else None
        out.append(entry)
    return out


@contextmanager
def track_step_memory(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, *, fsdp2: bool,
    device: torch.device, held: Sequence[torch.Tensor] = (), timeline: bool = False,
    block_type: type[nn.Module] | None = None,
) -> Iterator[MemoryProbe]:
    """Track one training step computed on `device`; ``probe.result()`` gives its StepMemory.

    ``held``: tensors an engine made before the step and keeps outside the module's
    parameters and the optimizer's state (DeepSpeed's fp32 master partitions, ZeRO-3's
    parameter partitions); the tracker cannot see them otherwise. Counted as "other".

    CPU vs CUDA follows `device`, not where the parameters live. A bare "cuda" means the
    current CUDA device (the trackers key their snapshots by an indexed device).

    ``timeline``: also record the step's events (module docstring, "Timeline").
    ``block_type``: the model's repeated block, which decides its top-level modules (module
    docstring, "Per module").
    """
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    if on_cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tracker, name = mem_trackers.make_tracker(module, optimizer, fsdp2, held)
    async_frees = _AsyncFrees(tracker)
    events = _Timeline(tracker, device) if timeline else None
    probe = MemoryProbe(tracker, device)
    rss_ok = _reset_rss_peak()
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
    async_frees.counting = True
    # Future callbacks run untracked wherever they run (module docstring, "Frees and
    # allocations on another thread").
    with futures.callbacks_under(_untracked), tracker, \
            nullcontext() if on_cuda else _pause_after_waits(RELEASE_PAUSE_S):
        yield probe
    async_frees.counting = False
    rss = _rss_peak() if rss_ok else None
    peaks = tracker.get_tracker_snapshot("peak")
    at_optimizer_step = probe._at_optimizer_step
    modules = _module_peaks(tracker, module, block_type, device) if block_type is not None else []
    # The tracker sits in reference cycles (its weakref callbacks point back at it) that
    # keep the model's parameters alive until a collection after the model is dropped;
    # collecting here, while the model is still alive, lets the caller free it by refcount.
    del tracker, probe._tracker
    gc.collect()
    timeline_events = None if events is None else events.events
    timeline_truncated = False if events is None else events.truncated

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
                                   at_optimizer_step_bytes=at_optimizer_step, async_freed_bytes=async_frees.bytes,
                                   timeline=timeline_events, timeline_truncated=timeline_truncated, modules=modules)
    else:
        breakdown = _breakdown(peaks.get(torch.device("cpu"), {"Total": 0}))
        probe._result = StepMemory(peak_bytes=sum(breakdown.values()), breakdown_bytes=breakdown,
                                   rss_peak_bytes=rss, cuda=None, tracker=name,
                                   at_optimizer_step_bytes=at_optimizer_step, async_freed_bytes=async_frees.bytes,
                                   timeline=timeline_events, timeline_truncated=timeline_truncated, modules=modules)
