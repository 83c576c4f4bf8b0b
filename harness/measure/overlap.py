"""Exposed communication: how much of a step's collective time no compute hides, read from
the comm step's profiler timeline (measure/comm.py ``count_comm`` gathers the intervals).

- busy_s: the length of the union of the intervals in which a collective runs (gloo: its
  worker thread's "gloo:<op>" event, which includes waiting for the peer; NCCL: its kernel).
  Collectives that run at the same time count once, so busy_s can be less than the sum of
  the ops' times (metrics.comm_time_s_per_step).
- exposed_s: the part of busy_s during which no compute runs: on the CPU, no aten op on the
  step's own thread (gloo computes its reductions on its own threads, which are
  communication); on CUDA, no other kernel on the GPU. This is the communication a faster
  fabric would take off the step; the rest ran behind compute.
- overlap_fraction: 1 − exposed_s ÷ busy_s; None for a step without collectives.

On the CPU "behind compute" is a statement about the timeline, not a free lunch: gloo's
threads take their cycles from the cores the ranks compute on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

Interval = tuple[int, int]  # [start, end) in nanoseconds


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as disjoint intervals in order."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(intervals: list[Interval]) -> int:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The overlap of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True, kw_only=True)
class Exposure:
    busy_s: float
    exposed_s: float

    @property
    def overlap_fraction(self) -> float | None:
        return 1.0 - self.exposed_s / self.busy_s if self.busy_s > 0 else None

    def to_record(self) -> dict[str, float | None]:
        return {"busy_s": self.busy_s, "exposed_s": self.exposed_s, "overlap_fraction": self.overlap_fraction}


def exposure(comm: Iterable[Interval], compute: Iterable[Interval]) -> Exposure:
    """The collectives' busy time and the part of it no compute interval covers."""
    busy = merged(comm)
    hidden = _intersection(busy, merged(compute))
    return Exposure(busy_s=_length(busy) / 1e9, exposed_s=(_length(busy) - _length(hidden)) / 1e9)
