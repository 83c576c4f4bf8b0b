"""A first-order wall time for a matrix on GPUs, written down before it runs: what `list`
prints for a GPU target, so a user knows what the real-size default will take.

Per step: the cell's model FLOPs on one rank at ``ASSUMED_MFU`` of the GPU's dense peak
(measure/flops.py), plus the analytic communication volume per rank at ``ASSUMED_BUS_BW``,
not overlapped. Per cell: ``CELL_START_S`` (the model built and sharded, the warm-up's
first-step compiles and allocations) on top of its steps. Offload's host traffic and the
CPU optimizer step are not in it. These are assumptions stated here, not measurements: the
step-time predictor that replaces them is checked against measured step times.
"""

from __future__ import annotations

from harness import models
from harness.config import CellSpec
from harness.measure import flops
from harness.predict import analytic

ASSUMED_MFU = 0.4  # what well-tuned dense training reaches on H100 (torchtitan's Llama-3 8B: 38-42 %)
ASSUMED_BUS_BW = 300e9  # B/s: NVLink all-reduce bus bandwidth of an 8×H100 SXM node, below nccl-tests' ~450
CELL_START_S = 30.0
ASSUMED_GPU = "NVIDIA H100 80GB HBM3"  # whose peak is used where the target GPU is not named


def cell_seconds(cell: CellSpec, gpu_name: str | None) -> float:
    """The cell's rough wall time on ``gpu_name`` (H100 SXM where None or unknown)."""
    peak = flops.peak_flops(gpu_name, cell.strategy.precision) or flops.peak_flops(ASSUMED_GPU,
                                                                                   cell.strategy.precision)
    if peak is None:
        raise ValueError(f"no peak FLOP/s for precision {cell.strategy.precision}")
    compute = models.flops_per_sample(cell.model_spec) * cell.global_batch / cell.world_size / (peak * ASSUMED_MFU)
    predicted = analytic.predict(cell)
    comm = predicted.get("comm_volume_per_step", 0) / ASSUMED_BUS_BW
    return CELL_START_S + cell.steps * (compute + comm)
