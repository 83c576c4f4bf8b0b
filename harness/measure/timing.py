"""Step time: wall clock around a whole optimizer step, device-synchronised, warm-up excluded
by the caller; summarised as median and inter-quartile range (robust on a shared machine)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def timed(device: torch.device, samples: list[float]) -> Iterator[None]:
    """Append the duration of the block to ``samples``. On CUDA, kernels still queued when
    the block ends belong to it, so synchronise at both edges."""
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
