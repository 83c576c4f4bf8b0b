"""Whether a cell is predicted to fit its device, decided before anything is launched: the
analytic predictor's whole peak per rank against the memory a rank may use.

A rank may use ``USABLE_FRACTION`` of its device's memory: the CUDA context, NCCL's buffers
and the caching allocator's fragmentation (reserved beyond allocated) take the rest. A cell
predicted above it is recorded ``does_not_fit`` with both numbers instead of being launched
(``--launch-anyway`` launches it to find out); a cell the analytic model does not describe
(a factory's model) is launched. The same rule sizes the GPU matrix's batches
(harness/suites_gpu.py) and ``plan --global-batch``'s micro-batches (``sized``), so the
matrix, the plan and the run agree on what fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass

from harness.config import CellSpec
from harness.predict import analytic

USABLE_FRACTION = 0.9
# What offload may hold of a node's host memory (plan's --host-mem): the rest is the OS's, the
# ranks' own processes' (their libraries and CUDA's host-side state, a few GB a rank) and the
# data loaders'.
HOST_USABLE_FRACTION = 0.8


@dataclass(frozen=True, kw_only=True)
class Fit:
    predicted_peak_bytes: int  # the analytic whole peak per rank
    available_bytes: int  # the device's memory per rank (or --gpu-mem, or --mem-cap-gib)
    predictor: str = "analytic"

    @property
    def usable_bytes(self) -> int:
        return int(self.available_bytes * USABLE_FRACTION)

    @property
    def fits(self) -> bool:
        return self.predicted_peak_bytes <= self.usable_bytes

    def to_dict(self) -> dict[str, int | str | bool]:
        return {**asdict(self), "usable_bytes": self.usable_bytes, "fits": self.fits}

    def reason(self) -> str:
        return (f"predicted peak {self.predicted_peak_bytes / 2**30:.1f} GiB per rank ({self.predictor}) over the"
                f" {self.usable_bytes / 2**30:.1f} GiB usable of {self.available_bytes / 2**30:.1f} GiB"
                f" ({USABLE_FRACTION:.0%}); not launched (--launch-anyway runs it)")


def check(cell: CellSpec, available_bytes: int, device_type: str = "cuda") -> Fit | None:
    """The cell's fit on ``available_bytes`` per rank (of a ``device_type`` device); None
    where the analytic model has no prediction for the cell."""
    predicted = analytic.predict(cell, device_type=device_type)
    if "peak_bytes" not in predicted:
        return None
    return Fit(predicted_peak_bytes=int(predicted["peak_bytes"]), available_bytes=int(available_bytes))


def sized(cell: CellSpec, batch: int, fits: Callable[[CellSpec], bool]) -> CellSpec | None:
    """``cell`` at global batch ``batch``: the largest power-of-two micro-batch that divides
    its share and ``fits``, the accumulation making up the rest (a practitioner's rule: the
    fewest micro-steps, so the fewest per-micro-step gathers and the largest matmuls; a
    pipeline's own micro-batches do that for it, so it keeps accumulation 1); micro-batch 1
    where none fits. None where the batch does not divide over the cell's ranks. The cell's
    own accumulation is kept as a factor (a variant that accumulates on purpose)."""
    unit = dataclasses.replace(cell, micro_batch=1, strategy=dataclasses.replace(cell.strategy, accumulation=1))
    extra_accumulation = cell.strategy.accumulation
    if batch % (unit.global_batch * extra_accumulation):
        return None
    share = batch // (unit.global_batch * extra_accumulation)  # samples per rank per step
    candidates = []
    for micro_batch in (m for m in range(share, 0, -1) if share % m == 0 and m & (m - 1) == 0):
        accumulation = share // micro_batch * extra_accumulation
        if cell.strategy.pipelined and accumulation != 1:
            continue
        try:
            candidates.append(dataclasses.replace(
                cell, micro_batch=micro_batch, strategy=dataclasses.replace(cell.strategy, accumulation=accumulation)))
        except ValueError:
            continue
    if not candidates:
        return None
    return next((c for c in candidates if fits(c)), candidates[-1])
