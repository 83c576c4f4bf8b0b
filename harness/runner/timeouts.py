"""How long a cell may go without progress before the launcher declares it hung.

``--cell-timeout S`` sets one limit for every cell. By default the limit scales with the
cell: ``START_UP_S`` (imports, the rendezvous, DeepSpeed's op builds from a warm cache, and
every launch's first cell pays the launch) plus ``SAFETY`` × the cell's expected compute:
the model FLOPs of all its steps on one rank ÷ this device's rate at the cell's precision.

The rate is measured, never assumed: on the CPU a one-thread matmul in the cell's precision
(each rank computes with one thread; bf16 and fp16 matmuls have kernels of their own, fast or
not depending on the CPU), on CUDA the device's dense peak (measure/flops.py). A tiny model
reaches a few per cent of a matmul's rate, which SAFETY allows for. A CUDA device missing
from the peak table gets ``FALLBACK_S``, and the limit's description says so.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from harness import models
from harness.config import CellSpec
from harness.features import precision as precisions
from harness.measure import flops

START_UP_S = 300.0
SAFETY = 20.0
# A CPU cell whose steps would each take longer than this at the measured rate is not run:
# it is recorded ``unsupported`` with the arithmetic (``too_slow_reason``).
MAX_CPU_STEP_S = 60.0
FALLBACK_S = 600.0
_MATMUL_N = 512
_MEASURE_FOR_S = 0.2


@dataclass(frozen=True, kw_only=True)
class CellTimeout:
    seconds: float
    why: str  # how the limit came about, for the record of a cell that hit it


@functools.cache
def cpu_flops_per_s(precision: str) -> float:
    """One CPU thread's matmul rate in ``precision``, measured here."""
    dtype = precisions.DTYPES[precision]
    a = torch.randn(_MATMUL_N, _MATMUL_N, dtype=dtype)
    b = torch.randn(_MATMUL_N, _MATMUL_N, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a @ b  # first call: one-off kernel selection
        runs, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < _MEASURE_FOR_S:
            a @ b
            runs += 1
    finally:
        torch.set_num_threads(threads)
    return 2 * _MATMUL_N**3 * runs / elapsed


def _flops_per_s(cell: CellSpec, device_type: str, device_name: str | None) -> float | None:
    if device_type == "cuda":
        return flops.peak_flops(device_name, cell.strategy.precision)
    return cpu_flops_per_s(cell.strategy.precision)


def expected_compute_s(cell: CellSpec, rate: float) -> float:
    """Model FLOPs of every step of ``cell`` on one rank, at ``rate`` FLOP/s."""
    per_sample = models.flops_per_sample(cell.model_spec)
    return per_sample * cell.global_batch * cell.steps / cell.world_size / rate


def for_cell(cell: CellSpec, fixed_s: float | None, device_type: str, device_name: str | None) -> CellTimeout:
    """The cell's limit: ``fixed_s`` (--cell-timeout) when given, else scaled to the cell."""
    if fixed_s is not None:
        return CellTimeout(seconds=fixed_s, why=f"--cell-timeout {fixed_s:.0f} s")
    rate = _flops_per_s(cell, device_type, device_name)
    if rate is None:
        return CellTimeout(seconds=FALLBACK_S, why=f"{FALLBACK_S:.0f} s: no FLOP rate known for {device_name},"
                                                   " so not scaled to the cell; --cell-timeout sets it")
    expected = expected_compute_s(cell, rate)
    return CellTimeout(seconds=START_UP_S + SAFETY * expected,
                       why=f"{START_UP_S:.0f} s start-up + {SAFETY:.0f} × {expected:.2f} s expected compute"
                           f" at {rate / 1e9:.1f} GFLOP/s; --cell-timeout sets it")


def too_slow_reason(cell: CellSpec, device_type: str) -> str | None:
    """Why a CPU cell cannot run here in useful time, or None: its model FLOPs per step on
    one rank at this CPU's measured one-thread matmul rate in the cell's precision, a lower
    bound on its step time, over ``MAX_CPU_STEP_S``. What it catches is a precision this CPU
    computes without units of its own: bf16 without AVX512-BF16 or AMX is emulated, 20-40x
    slower than fp32 (a gpt2-124m bf16 step at 256 tokens takes minutes)."""
    if device_type != "cpu":
        return None
    rate = cpu_flops_per_s(cell.strategy.precision)
    per_step = expected_compute_s(cell, rate) / cell.steps
    if per_step <= MAX_CPU_STEP_S:
        return None
    fp32 = cpu_flops_per_s("fp32")
    return (f"a step would take at least {per_step:.0f} s on this CPU ({models.flops_per_sample(cell.model_spec):.2e}"
            f" FLOPs per sample at its measured {cell.strategy.precision} matmul rate of {rate / 1e9:.1f} GFLOP/s"
            f" per thread, against {fp32 / 1e9:.1f} in fp32), over the {MAX_CPU_STEP_S:.0f} s a CPU step may take"
            f" (harness/runner/timeouts.py); it runs where the CPU computes {cell.strategy.precision} natively,"
            " and on GPUs")
