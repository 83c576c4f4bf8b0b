"""Step time: wall clock around a whole optimizer step, every rank starting it together,
device-synchronised, warm-up excluded by the caller; summarised as median and inter-quartile
range (robust on a shared machine)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


@contextmanager
def timed(device: torch.device, samples: list[float]) -> Iterator[None]:
    """Append the duration of the block to ``samples``. The ranks of the process group start
    it together (a barrier before the clock): a rank held up after its last collective of the
    step before (the host's other work taking its core, the harness's own bookkeeping between
    steps) would otherwise be counted twice, in its own step and in the other ranks' wait at
    this step's first collective, and the metric is each step's slowest rank
    (measure/summary.py). On CUDA, kernels still queued when the block ends belong to it, so
    synchronise at both edges."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples.append(time.perf_counter() - start)


def median_iqr(samples: list[float]) -> tuple[float, float]:
    if len(samples) == 1:
        return samples[0], 0.0
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q2, q3 - q1
