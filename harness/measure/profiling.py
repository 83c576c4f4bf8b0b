"""``--profile``: a torch.profiler trace of a cell's timed steps, per rank, as Chrome trace
JSON (chrome://tracing, Perfetto's ui.perfetto.dev and TensorBoard's profiler plugin open
it), with shapes and memory events; on CUDA also the GPU kernels. Off by default: a profiled
step is slower than an unprofiled one (the profiler records every op), so a profiled run's
step times include that overhead and an unprofiled run never starts the profiler in a timed
step (measure/comm.py profiles the comm step, which is not timed).

On CUDA the cell's page also prints the Nsight Systems command that profiles the same cell
(harness/report/html.py): what NVIDIA's own tools see, kernels and copies on every stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

# What the record names the trace by: its path relative to the run folder (profiles' parent).
TRACE_NAME = "rank{rank}.trace.json"


@contextmanager
def profiled(folder: Path | None, rank: int, on_cuda: bool) -> Iterator[dict[str, str | None]]:
    """Profile the block into ``folder``/rank<r>.trace.json (nothing without a folder); the
    dict it yields gets ``profile_trace``, the trace's path relative to the run folder."""
    result: dict[str, str | None] = {"profile_trace": None}
    if folder is None:
        yield result
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
        yield result
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / TRACE_NAME.format(rank=rank)
    prof.export_chrome_trace(str(trace))
    result["profile_trace"] = str(trace.relative_to(folder.parents[1]))

