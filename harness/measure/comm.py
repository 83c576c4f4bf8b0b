"""Communication per collective kind during one step: count, bytes, time.

    with count_comm(torch.device("cpu")) as comm:
        step()
    stats = comm().by_op   # {"all_reduce": OpStats(count=1, bytes=49792, time_s=0.0014), ...}
    comm().exposure        # the collectives' busy time and how much of it no compute hid

The profiler adds overhead: run this on its own step, not on a timed one.

Sources
- count and bytes: a TorchDispatchMode over the c10d ops (``torch.ops.c10d.*``) and the
  functional collectives (``torch.ops._c10d_functional.*``, used by DTensor). On torch 2.13
  the C++ ProcessGroup methods go through the dispatcher, so this also sees what C++ issues:
  DDP's reducer all-reduce from the autograd engine, FSDP1's all-gather/reduce-scatter, FSDP2's
  ``_allgather_base_``/``_reduce_scatter_base_``, ZeroRedundancyOptimizer's broadcasts.
  Ops are reported as issued: a reduce-scatter counts as "reduce_scatter" even on gloo,
  which runs it as an all-reduce of the full input.
- time_s: torch.profiler (record_shapes). gloo runs each collective on its own worker
  threads under a "gloo:<op>" event, whose duration includes waiting for the peer. With
  NCCL the collective's time is the duration of its GPU kernel ("ncclDevKernel_<Op>...").
  Each profiler event is matched, in issue order, to the first unmatched dispatched op of a
  compatible kind and (when the event has shapes) the same input element count; gloo's
  "all_reduce" for a reduce-scatter thus adds to "reduce_scatter". An unmatched event whose
  kind the dispatch mode did see adds its time there; one of a kind the dispatch mode did not
  see at all is counted from the profiler alone (bytes from its input shapes and dtypes), so
  a collective missed by the dispatch mode is never reported as zero; an NCCL kernel has no
  shapes, so such a call is counted and timed with its bytes unknown, and the op's
  ``unsized`` says how many calls that was. time_s is 0.0 where no profiler event matched.
- collectives issued from a future's callback: a dispatch mode (and the profiler) is
  per-thread state, and ``Future.then`` does not carry it to the thread that runs the
  callback — gloo's worker thread when the future completes later. PowerSGD's hook issues
  its P and Q all-reduces from such callbacks (``fut.then(...)``); neither source would see
  them, and a PowerSGD step would show only its first all-reduce. While counting,
  each callback runs under a counting mode (measure/futures.py; sharing
  this step's list) when the thread that runs it has none. The profiler does not follow
  them there either: such an op is counted with its bytes and time_s 0.0 (a callback that
  runs inline, on a future already complete, stays on the counting thread and is timed).

- exposure: from the same profile, the intervals in which collectives ran and those in
  which the step computed (on the CPU, aten ops on the step's own thread, found by the
  ``STEP_MARKER`` around the step; on CUDA, the GPU's other kernels), measured by
  measure/overlap.py.

Bytes convention (this rank's payload, per op)
- all_reduce, broadcast, reduce, send, recv: the tensor bytes.
- all_gather: output bytes (the full gathered size).
- reduce_scatter, all_to_all, gather: input bytes (the full size for reduce_scatter).
- scatter: output bytes (this rank's piece).
- barrier: 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from harness.measure import futures, overlap
from harness.measure.overlap import Interval

# Marks the counted step on the thread that runs it: that thread's aten ops are its compute.
STEP_MARKER = "shardbench::counted_step"


@dataclass(frozen=True, kw_only=True)
class OpStats:
    count: int
    bytes: int
    time_s: float
    # Of ``count``, the calls seen only by the profiler with nothing to size them by (an NCCL
    # kernel carries no shapes): counted and timed, their bytes missing from ``bytes``.
    unsized: int = 0

    def to_record(self) -> dict[str, int | float]:
        """The record's entry; ``unsized`` only where there were such calls."""
        return {"count": self.count, "bytes": self.bytes, "time_s": self.time_s,
                **({"unsized": self.unsized} if self.unsized else {})}


# op name -> (kind, where the counted bytes are, where the input tensors are).
# Positions index the op's args; "out" is the op's return value (functional ops).
_OpSpec = tuple[str, int | Literal["out"] | None, int | None]
_C10D: dict[str, _OpSpec] = {
    "allreduce_": ("all_reduce", 0, 0),
    "allreduce_coalesced_": ("all_reduce", 0, 0),
    "allgather_": ("all_gather", 0, 1),
    "_allgather_base_": ("all_gather", 0, 1),
    "allgather_coalesced_": ("all_gather", 0, 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 1),
    "reduce_scatter_": ("reduce_scatter", 1, 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 1),
    "broadcast_": ("broadcast", 0, 0),
    "reduce_": ("reduce", 0, 0),
    "send": ("send", 0, 0),
    "recv_": ("recv", 0, 0),
    "recv_any_source_": ("recv", 0, 0),
    "alltoall_": ("all_to_all", 1, 1),
    "alltoall_base_": ("all_to_all", 1, 1),
    "gather_": ("gather", 1, 1),
    "scatter_": ("scatter", 0, 0),
    "barrier": ("barrier", None, None),
    "monitored_barrier_": ("barrier", None, None),
}
_FUNCTIONAL: dict[str, _OpSpec] = {
    "all_reduce": ("all_reduce", 0, 0),
    "all_reduce_": ("all_reduce", 0, 0),
    "all_reduce_coalesced": ("all_reduce", 0, 0),
    "all_reduce_coalesced_": ("all_reduce", 0, 0),
    "all_gather_into_tensor": ("all_gather", "out", 0),
    "all_gather_into_tensor_out": ("all_gather", "out", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", "out", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 0),
    "reduce_scatter_tensor_out": ("reduce_scatter", 0, 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, 0),
    "all_to_all_single": ("all_to_all", 0, 0),
    "broadcast": ("broadcast", 0, 0),
    "broadcast_": ("broadcast", 0, 0),
    "isend": ("send", 0, 0),
    "irecv": ("recv", 0, 0),
}
_TABLES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL}

# Profiler name fragments -> kind. gloo: "gloo:<name>"; NCCL kernels: "ncclDevKernel_<Name>_...".
_PROFILER_KIND = {
    "all_reduce": "all_reduce", "AllReduce": "all_reduce",
    "all_gather": "all_gather", "AllGather": "all_gather",
    "reduce_scatter": "reduce_scatter", "ReduceScatter": "reduce_scatter",
    "broadcast": "broadcast", "Broadcast": "broadcast",
    "reduce": "reduce", "Reduce": "reduce",
    "send": "send", "recv": "recv", "SendRecv": "send_recv",
    "all_to_all": "all_to_all", "alltoall": "all_to_all",
    "gather": "gather", "scatter": "scatter", "barrier": "barrier",
}
# Profiler kind -> dispatched kinds it may stand for (gloo runs reduce_scatter as all_reduce;
# NCCL runs p2p and all_to_all as SendRecv kernels).
_COMPATIBLE = {"all_reduce": ("all_reduce", "reduce_scatter"),
               "send_recv": ("send", "recv", "all_to_all")}
# Profiler dtype strings (record_shapes) -> element size, for the profiler-only fallback.
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "int": 4,
                "long int": 8, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}


def busbw_factor(op: str, world_size: int) -> float:
    """Bus-bandwidth factor of nccl-tests: busbw = algbw * factor."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send", "recv", "send_recv"):
        return 1.0
    raise ValueError(f"no bus-bandwidth factor for {op!r}")


def _tensors(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


@dataclass
class _Op:
    kind: str
    bytes: int
    in_numel: int | None  # what the profiler shows as the input, for matching
    time_s: float = 0.0
    timed: bool = False  # a profiler event has been matched to this op


class _CommDispatchMode(TorchDispatchMode):
    def __init__(self, ops: list[_Op] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        # Shared with the modes that count on callback threads (one list per step).
        self.ops: list[_Op] = [] if ops is None else ops

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Collection[type],
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        # Let tensor subclasses (DTensor, AsyncCollectiveTensor) desugar first: the plain-tensor
        # collectives they issue then come back through this mode.
        if any(t not in (torch.Tensor, nn.Parameter) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        call = collective_call(func, args, out)
        if call is not None:
            self.ops.append(_Op(*call))
        return out


def collective_call(func: torch._ops.OpOverload, args: tuple[Any, ...], out: Any) -> tuple[str, int, int | None] | None:
    """(kind, bytes by the module's convention, input elements) of a dispatched c10d or
    functional collective; None for any other op."""
    spec = _TABLES.get(func.namespace, {}).get(func._opname)
    if spec is None:
        return None
    kind, at_bytes, at_input = spec

    def src(at: int | Literal["out"]) -> Any:
        return out if at == "out" else args[at]

    nbytes = 0 if at_bytes is None else sum(t.nbytes for t in _tensors(src(at_bytes)))
    numel = None if at_input is None else sum(t.numel() for t in _tensors(src(at_input)))
    return kind, nbytes, numel


def _profiler_kind(name: str) -> str | None:
    if name.startswith("gloo:"):
        return _PROFILER_KIND.get(name[len("gloo:"):])
    for prefix in ("ncclDevKernel_", "ncclKernel_"):
        if name.startswith(prefix):
            # "AllReduce_Sum_f32_RING_LL", "SendRecv(ncclDevKernelArgsStorage<4096ul>)"
            letters = re.match(r"[A-Za-z]*", name[len(prefix):])
            assert letters is not None  # [A-Za-z]* matches every string (if only by its empty prefix)
            return _PROFILER_KIND.get(letters.group())
    return None


@dataclass(frozen=True)
class _Event:
    """A profiler event of a collective: gloo's worker-thread op or an NCCL kernel."""

    name: str
    kind: str  # _profiler_kind(name)
    start_ns: int
    duration_ns: int
    input_shapes: list[list[int]]  # empty for a GPU kernel
    input_dtypes: list[str]


def _raw_events(prof: profile) -> list[Any]:
    """kineto's raw events: torch's ``prof.events()`` first builds every op's FunctionEvent
    and their tree (0.3 s a tiny step on the reference host, a quarter of a cell's time),
    and only a few of them are needed."""
    return list(prof.profiler.kineto_results.events()) if prof.profiler and prof.profiler.kineto_results else []


def _comm_events(raw: list[Any]) -> list[_Event]:
    """The profile's collective events."""
    return [_Event(e.name(), kind, e.start_ns(), e.duration_ns(), e.shapes(), e.dtypes())
            for e in raw if (kind := _profiler_kind(e.name())) is not None]


def _compute_intervals(raw: list[Any], on_cuda: bool) -> list[Interval]:
    """When the step computed (module docstring, exposure)."""
    if on_cuda:
        return [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in raw
                if e.device_type() == DeviceType.CUDA and _profiler_kind(e.name()) is None
                and not e.name().startswith(("Memcpy", "Memset"))]
    step_threads = {e.start_thread_id() for e in raw if e.name() == STEP_MARKER}
    return [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in raw
            if e.start_thread_id() in step_threads and e.name().startswith("aten::")]


def _event_numel_bytes(event: _Event) -> tuple[int | None, int | None]:
    shapes = [s for s in (event.input_shapes or []) if s]
    if not shapes:
        return None, None
    numels = [int(torch.Size(s).numel()) for s in shapes]
    sizes = [_DTYPE_BYTES.get(d) for d in event.input_dtypes[: len(numels)]]
    known = [s for s in sizes if s is not None]
    nbytes = None if len(known) < len(sizes) else sum(n * s for n, s in zip(numels, known))
    return sum(numels), nbytes


def _summarise(ops: list[_Op], events: Iterable[_Event]) -> dict[str, OpStats]:
    seen_kinds = {op.kind for op in ops}
    extra: dict[str, list[float]] = {}  # profiler-only kind -> [count, bytes, time, unsized]
    for event in sorted(events, key=lambda e: e.start_ns):
        kind = event.kind
        seconds = event.duration_ns / 1e9
        numel, nbytes = _event_numel_bytes(event)
        allowed = _COMPATIBLE.get(kind, (kind,))
        match = next((op for op in ops if not op.timed and op.kind in allowed
                      and (numel is None or op.in_numel in (None, numel))), None)
        if match is not None:
            match.time_s, match.timed = seconds, True
        elif any(k in seen_kinds for k in allowed):
            # e.g. one dispatched op the backend split into several events
            next(op for op in ops if op.kind in allowed).time_s += seconds
        else:
            count, total, time_s, unsized = extra.get(kind, (0, 0, 0.0, 0))
            extra[kind] = [count + 1, total + (nbytes or 0), time_s + seconds, unsized + (nbytes is None)]

    result: dict[str, OpStats] = {}
    for kind in dict.fromkeys(op.kind for op in ops):
        mine = [op for op in ops if op.kind == kind]
        result[kind] = OpStats(count=len(mine), bytes=sum(op.bytes for op in mine),
                               time_s=sum(op.time_s for op in mine))
    for kind, (count, total, time_s, unsized) in extra.items():
        result[kind] = OpStats(count=int(count), bytes=int(total), time_s=time_s, unsized=int(unsized))
    return result


def _counting_on_this_thread() -> bool:
    return any(isinstance(m, _CommDispatchMode) for m in _get_current_dispatch_mode_stack())


@dataclass(frozen=True, kw_only=True)
class CommStep:
    by_op: dict[str, OpStats]
    exposure: overlap.Exposure


# The one-process reference's step: no peer, no collective (counted for real, it counts none:
# tests/test_measure_comm.py).
NO_COLLECTIVES = CommStep(by_op={}, exposure=overlap.Exposure(busy_s=0.0, exposed_s=0.0))


@contextmanager
def count_comm(device: torch.device) -> Iterator[Callable[[], CommStep]]:
    """Count the collectives issued inside the block (on this thread, and in future
    callbacks registered in it) and time how much of them compute hid; the callable returns
    them after it."""
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU]
    if on_cuda:
        activities.append(ProfilerActivity.CUDA)
    mode = _CommDispatchMode()
    result: list[CommStep] = []
    with profile(activities=activities, record_shapes=True) as prof:
        # Callbacks count into this step's list on whichever thread runs them (measure/futures.py).
        counting = lambda: nullcontext() if _counting_on_this_thread() else _CommDispatchMode(mode.ops)  # noqa: E731
        with futures.callbacks_under(counting), mode, record_function(STEP_MARKER):
            yield lambda: result[0]
        if on_cuda:
            torch.cuda.synchronize(device)  # let the NCCL kernels finish inside the profile
    raw = _raw_events(prof)
    events = _comm_events(raw)
    result.append(CommStep(by_op=_summarise(mode.ops, events),
                           exposure=overlap.exposure([(e.start_ns, e.start_ns + e.duration_ns) for e in events],
                                                     _compute_intervals(raw, on_cuda))))
