"""How fast the run's ranks compute, measured once per run in the bandwidth sweep's launch
(harness/measure/bandwidth.py ``main``): the rates the step-time predictor
(harness/predict/step_time.py) prices a step's dispatched work at.

The rates, each timed on every rank at once (the ranks share the host's cores and memory
bus as a cell's ranks do; the slowest rank's time is kept) and again on rank 0 alone while
the others wait (as the single-process reference runs; a one-rank launch times them once):

- ``matmul_flops_per_s``, per precision: a square matmul of ``MATMUL_SIZE`` (CPU: 512, one
  thread's tile-friendly size; CUDA: 8192, large enough to reach the tensor cores' rate),
  2·n³ FLOPs a call; and ``matmul_flops_per_s_by_size``, [[FLOPs a call, FLOP/s], ...], the
  same for each square size of ``MATMUL_SIZES``: a 32² matmul runs at a few percent of a
  512²'s rate, and a step's matmuls are priced by their own size (log-log between sizes in
  FLOPs a call, the largest's rate above it).
- ``matmul_efficiency``, per precision: the largest matmul's rate (every rank busy) over the
  device's dense datasheet peak (``datasheet_peak_flops_per_s``, measure/flops.py, by the
  ``device_name`` CUDA reports), the efficiency a plan prices a GPU at where it has this
  run's calibration (predict/rough_time.py); a device flops.py does not list, any CPU among
  them, records ``no_datasheet_peak`` instead.
- ``attention_flops_per_s_by_size``, per precision and direction ("forward", "backward"):
  [[FLOPs per (sample, head), FLOP/s], ...] of causal scaled-dot-product attention (the
  kernel torch picks for the device: the CPU's flash attention) on ``ATTENTION_HEADS``
  (sample, head) pairs at each (sequence, head width) of ``ATTENTION_SHAPES``; the backward's
  time is the forward-and-backward call's less the forward's. The kernels run at rates of
  their own, far from a matmul's of the same FLOPs: on this project's CPU host a bf16
  attention backward at 32 tokens of width 16 to 24 (the tiny and byte-level presets) runs at
  1.5-4 GFLOP/s against fp32's 17-30 and a bf16 matmul's hundreds: two fifths of a bf16
  byte-level GPT-2 step (torch's FLOP registry lacks the CPU's flash attention kernels, which
  dispatched_work counts by SDPA's formulas).
- ``convolution_flops_per_s_by_size``, the same for a 3×3 convolution (per call, by its
  FLOPs) of ``CONVOLUTION_BATCH`` images at each (channels, side) of ``CONVOLUTION_SHAPES``: a
  small convnet's convolutions run at half a matmul's rate of the same FLOPs. On the CPU fp16's
  only at the first shape, a rate for every size: without fp16 units its backward takes 30 ms
  there and 430 ms at the second.
- ``topk_elements_per_s_by_size``: [[elements, elements/s], ...], an unsorted top-k of a
  hundredth of an fp32 vector's entries (gradient sparsification's density), at each size of
  ``TOPK_ELEMENTS``: a partial sort, which on the CPU reads its input at a thirtieth of the
  STREAM add's bandwidth.
- ``optimizer_op_s``: {optimizer_op_key: {"call_s", "element_s"}}, what one call of an
  optimizer's library update op (dispatched_work's ``optimizer_ops``: bitsandbytes') costs
  beyond its dispatch and its bytes (priced as any op's), per call and per element: each of
  the library's optimizers (features/optimizers.py ``BITSANDBYTES``) steps one fp32 parameter
  at each of ``OPTIMIZER_OP_ELEMENTS`` (either side of bitsandbytes' ``min_8bit_size``, below
  which its 8-bit optimizers update in 32 bits), and a least-squares line through each op's
  remainders gives the two. On this project's CPU host block-wise 8-bit Adam costs about
  0.1 ms a call and 20 ns an element beyond its bytes: a tiny preset's 8-bit step is half
  optimizer. ``optimizer_op_unavailable`` says why for any it could not time (bitsandbytes
  not installed, its kernels not loading).
- ``memory_bytes_per_s``: [[working set, bytes/s], ...], an out-of-place add of two fp32
  vectors (STREAM's "add": three vectors' bytes a call, the working set) at each of
  ``STREAM_ELEMENTS``, from a first-level cache's size to beyond any last-level cache's: an
  op's bandwidth depends on where its tensors fit. The time of the same add on one element
  (the call's fixed cost, which ``op_s`` prices) is taken off each timing first.
- ``memory_factor`` and ``op_s`` (per precision), from a training step of a transformers
  decoder at the tiny preset's sizes (``OP_COST_MODEL``: 2 layers of width 64, 32 tokens;
  forward, backward and AdamW; bf16 and fp16 under autocast, as the cells run them), each
  step's work counted once by a dispatch mode (measure/dispatched_work.py: its ops, its
  matmuls' FLOPs by torch's formulas and by call size, its other ops' bytes by size). The fp32
  steps at more samples (``OP_COST_SAMPLES``' second) and of the wide decoder
  (``OP_COST_WIDE``) are each run again with every op that moves bytes (what
  ``memory_bytes`` counts) timed inside its call (on CUDA by events around it): that time,
  less each call's fixed cost (what the same timing reads for an add of one element), over
  the same ops' bytes at the STREAM add's bandwidth for their sizes, is ``memory_factor`` at
  each step's typical op size. A model's elementwise ops run several times slower per byte
  than an add into a buffer that exists (each allocates its output, and GELU, softmax and the
  norms do math on every byte). Timed in place, not fitted: the bytes are the smallest part
  of the tiny step's growth with its batch (half a millisecond at the add's rate beside 5.7 ms
  of matmuls, from 2 to 16 samples), and the fit that took what the step grew beyond its
  kernels read 1.2 to 9.3 in five calibrations in a row on this project's CPU host, where
  this timing read 4.0 to 6.7 in four. It is measured in fp32 and holds for every precision. What
  is left of each precision's step at the fewer samples once its kernels and its bytes (at
  that factor) are taken off, divided by its ops, is ``op_s``: dispatch, autocast's and
  autograd's bookkeeping and the Python of transformers' modules around each op (a plain
  Sequential of Linear, LayerNorm and GELU modules, an op per module call, costs 5-6 µs). The
  engines' own hooks are not in it.

Each is the median of ``REPEATS`` timings of ``ITERS`` calls after ``WARMUP`` untimed ones,
fewer where the calls are slow (``seconds_per_call``).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from harness import models
from harness.distributed import DistEnv
from harness.features import optimizers
from harness.measure import flops
from harness.measure.dispatched_work import KERNEL_FAMILIES, Counting, counted_optimizer_step

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MATMUL_SIZE = {"cpu": 512, "cuda": 8192}
# Larger CPU sizes are left out: a 1024² bf16 matmul on a CPU without bf16 units takes ~2 s.
MATMUL_SIZES = {"cpu": (32, 64, 128, 256, 512), "cuda": (512, 1024, 2048, 4096, 8192)}
# (sequence, head width) of the attention timings: the tiny presets' heads, then a real model's
# at the real-size suite's sequence length.
ATTENTION_SHAPES = {"cpu": ((32, 16), (64, 32), (256, 64)),
                    "cuda": ((512, 128), (1024, 128), (4096, 128))}
ATTENTION_HEADS = {"cpu": 8, "cuda": 32}  # (sample, head) pairs a call: a few samples' worth
# (channels, image side) of the 3×3 convolution timings, on CONVOLUTION_BATCH images a call.
CONVOLUTION_SHAPES = {"cpu": ((32, 8), (64, 16)), "cuda": ((128, 56), (256, 28), (512, 14))}
CONVOLUTION_BATCH = {"cpu": 8, "cuda": 64}
KERNEL_ITERS = 2  # attention and top-k calls of milliseconds: two a timing, the median of REPEATS
TOPK_ELEMENTS = {"cpu": (2**12, 2**16, 2**20), "cuda": (2**20, 2**24, 2**27)}
# Two sizes either side of bitsandbytes' min_8bit_size (4,096 elements): the nearest above it
# sets the 8-bit update's cost a call, the largest its cost an element.
OPTIMIZER_OP_ELEMENTS = {"cpu": (2**9, 2**11, 2**12, 2**17), "cuda": (2**9, 2**11, 2**12, 2**24)}
STREAM_ELEMENTS = {"cpu": tuple(2**k for k in range(10, 25, 3)), "cuda": tuple(2**k for k in range(16, 29, 3))}
WARMUP, ITERS, REPEATS = 2, 5, 5
OP_COST_MODEL = "llama-tiny"
OP_COST_SAMPLES = (2, 16)  # the calibration step's batch: the fewest samples, then eight times as many
# The same decoder 8 times as wide over 8 times the tokens (one sample, 6.6M parameters): ops of
# megabytes, where a model's elementwise ops lose less to allocation and math per byte.
OP_COST_WIDE = dataclasses.replace(models.PRESETS[OP_COST_MODEL], name=f"{OP_COST_MODEL}-wide",
                                   hidden=512, n_heads=8, seq_len=256)
SLOW_CALL_S = 0.05
# A timing's calls span at most about this long: at ~10 ms a call (a tiny step; an fp16 matmul of
# 256² on a CPU without fp16 units, 25 ms) five calls or two, not ten or eight. The median of
# REPEATS timings is what keeps a pre-empted span out; longer spans only made the calibration
# (every run's first launch) longer: 27 s of compute rates on this project's CPU host.
SPAN_S = 0.05


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(call: Callable[[], Any], device: torch.device, env: DistEnv, alone: bool,
                      iters: int = ITERS) -> float:
    """The median over REPEATS of (``iters`` calls' span ÷ ``iters``); the slowest rank's, or
    with ``alone`` rank 0's while the other ranks wait at a barrier. A first call, untimed,
    sizes the span: no more calls than fit in ``SPAN_S``, and a call that takes longer than
    ``SLOW_CALL_S`` (an fp16 or bf16 matmul on a CPU without units for it: a tenth of a second
    and more) is timed once a repeat with no warm-up call before it (the first call warmed
    what a cold start costs, microseconds of its tenths): its span needs no averaging, and
    the calibration stays seconds long."""
    runs = env.rank == 0 or not alone
    timings = []
    warmup = WARMUP
    if runs:
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        probe = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        if not alone:  # every rank makes as many calls: a distributed step's collectives pair up
            dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        first_s = float(probe.item())
        iters = max(1, min(iters, int(SPAN_S / first_s)))
        warmup = 0 if first_s > SLOW_CALL_S else min(WARMUP, iters)
    for _ in range(REPEATS):
        dist.barrier()
        if runs:
            for _ in range(warmup):
                call()
            _sync(device)
            start = time.perf_counter()
            for _ in range(iters):
                call()
            _sync(device)
            timings.append((time.perf_counter() - start) / iters)
    seconds = torch.tensor([statistics.median(timings) if timings else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def rate_at_size(points: list[list[float]], size: float) -> float:
    """The rate measured for a working set of ``size``: log-log between measured sizes, the
    nearest one's outside them."""
    sizes = [p[0] for p in points]
    if size <= sizes[0]:
        return points[0][1]
    if size >= sizes[-1]:
        return points[-1][1]
    i = bisect.bisect_left(sizes, size)
    (s0, r0), (s1, r1) = points[i - 1], points[i]
    weight = math.log(size / s0) / math.log(s1 / s0)
    return math.exp(math.log(r0) + weight * (math.log(r1) - math.log(r0)))


def matmul_seconds(work: dict[str, Any], rates: dict[str, Any], precision: str) -> float:
    """The time of a step's matmul FLOPs (DispatchedWork.to_dict's) at ``rates`` (one scope of
    ``measure``'s): each call size's FLOPs at the rate measured for that size; work or rates
    recorded before matmuls had sizes, every FLOP but the kernel families' at the one matmul rate."""
    by_size = rates.get("matmul_flops_per_s_by_size", {}).get(precision)
    if by_size and "matmul_flops_by_size" in work:
        return float(sum(flops / rate_at_size(by_size, size) for size, flops in work["matmul_flops_by_size"]))
    families = sum(flops for family in KERNEL_FAMILIES
                   for sizes in work.get(f"{family}_flops_by_size", {}).values() for _, flops in sizes)
    return float(work["matmul_flops"] - families) / float(rates["matmul_flops_per_s"][precision])


def family_seconds(work: dict[str, Any], rates: dict[str, Any], precision: str, family: str) -> float:
    """The time of a step's kernels of one of dispatched_work.KERNEL_FAMILIES: each direction's
    FLOPs per unit size at the rate measured for that direction and size; rates measured before
    the family was timed price them at the matmul rate."""
    curves = rates.get(f"{family}_flops_per_s_by_size", {}).get(precision)
    return float(sum(flops / (rate_at_size(curves[direction], size) if curves
                              else rates["matmul_flops_per_s"][precision])
                     for direction, sizes in work.get(f"{family}_flops_by_size", {}).items()
                     for size, flops in sizes))


def topk_seconds(work: dict[str, Any], rates: dict[str, Any]) -> float:
    """The time of a step's top-k selections, each size's elements at the rate measured for it."""
    return float(sum(elements / rate_at_size(rates["topk_elements_per_s_by_size"], size)
                     for size, elements in work.get("topk_elements_by_size", [])))


def optimizer_op_seconds(work: dict[str, Any], rates: dict[str, Any]) -> float:
    """What a step's optimizer library ops take beyond their dispatch and bytes, at the costs
    measured for each (none for an op the rates do not have: a run from before they were
    timed, or datasheet rates, which price its bytes alone)."""
    costs = rates.get("optimizer_op_s", {})
    return float(sum(calls * costs[key]["call_s"] + elements * costs[key]["element_s"]
                     for key, (calls, elements) in work.get("optimizer_ops", {}).items() if key in costs))


def kernel_seconds(work: dict[str, Any], rates: dict[str, Any], precision: str) -> float:
    """The time of a step's work that is priced by its own kernels' rates rather than by the
    bytes it moves: its matmuls, attention kernels, convolutions and top-k selections; and
    what its optimizer library ops cost beyond their bytes (which memory_seconds prices)."""
    return (matmul_seconds(work, rates, precision) + topk_seconds(work, rates) + optimizer_op_seconds(work, rates)
            + sum(family_seconds(work, rates, precision, family) for family in KERNEL_FAMILIES))


def memory_seconds(work: dict[str, Any], rates: dict[str, Any]) -> float:
    """The time of a step's other ops' bytes: each op size's at the STREAM add's bandwidth for
    that working set, times ``memory_factor`` at that size (1 where the rates have none)."""
    factors = rates.get("memory_factor")
    return float(sum(seconds * (rate_at_size(factors, size) if factors else 1.0)
                     for size, seconds in _stream_seconds_by_size(work, rates)))


def _stream_seconds_by_size(work: dict[str, Any], rates: dict[str, Any]) -> list[tuple[float, float]]:
    bandwidth = rates["memory_bytes_per_s"]
    return [(size, nbytes / rate_at_size(bandwidth, size)) for size, nbytes in work["memory_bytes"]]


def _typical_op_size(work: dict[str, Any]) -> float:
    """The op size a step's bytes are typical of: their byte-weighted geometric mean."""
    total = sum(nbytes for _, nbytes in work["memory_bytes"])
    return math.exp(sum(nbytes * math.log(size) for size, nbytes in work["memory_bytes"]) / total)


def _model_step(spec: models.ModelSpec, device: torch.device, precision: str,
                samples: int) -> tuple[Callable[[], None], dict[str, Any]]:
    """A training step of ``spec`` at ``precision`` on ``samples`` samples, and what one step
    dispatches (DispatchedWork.to_dict)."""
    built = models.build(spec)
    model = built.module.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {name: t.to(device) for name, t in built.make_batch(torch.Generator().manual_seed(0), samples).items()}
    dtype = PRECISIONS[precision]

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = built.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists before the counted step, as in a timed one
    with Counting() as counter:
        step()
    return step, counter.work.to_dict()


def _matmul_rates(dtype: torch.dtype, kind: str, device: torch.device, env: DistEnv,
                  alone: bool) -> list[list[float]]:
    """[[FLOPs a call, FLOP/s], ...] of square matmuls at MATMUL_SIZES, the last MATMUL_SIZE."""
    curve = []
    for n in MATMUL_SIZES[kind]:
        x, y = torch.ones(n, n, dtype=dtype, device=device), torch.ones(n, n, dtype=dtype, device=device)
        # Small matmuls are microseconds: enough of them that a timing spans about a millisecond.
        iters = max(ITERS, min(1000, (MATMUL_SIZE[kind] // n) ** 3))
        seconds = seconds_per_call(functools.partial(torch.mm, x, y), device, env, alone, iters)
        curve.append([2 * n**3, 2 * n**3 / seconds])
    return curve


# A kernel family's calls to time, each with how many units (dispatched_work.kernel_family) it covers.
Cases = Iterator[tuple[Callable[[], torch.Tensor], int]]


def _attention_cases(dtype: torch.dtype, kind: str, device: torch.device) -> Cases:
    """Causal SDPA on ATTENTION_HEADS (sample, head) pairs at each of ATTENTION_SHAPES."""
    for sequence, width in ATTENTION_SHAPES[kind]:
        shape = (1, ATTENTION_HEADS[kind], sequence, width)
        q, k, v = (torch.ones(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
        yield functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=True), shape[1]


def _convolution_cases(dtype: torch.dtype, kind: str, device: torch.device) -> Cases:
    """A 3×3 convolution of CONVOLUTION_BATCH images at each of CONVOLUTION_SHAPES; on the CPU
    fp16's at the first only (module docstring)."""
    shapes = CONVOLUTION_SHAPES[kind][:1] if kind == "cpu" and dtype == torch.float16 else CONVOLUTION_SHAPES[kind]
    for channels, side in shapes:
        images = torch.ones(CONVOLUTION_BATCH[kind], channels, side, side, dtype=dtype, device=device,
                            requires_grad=True)
        weight = torch.ones(channels, channels, 3, 3, dtype=dtype, device=device, requires_grad=True)
        yield functools.partial(torch.nn.functional.conv2d, images, weight, padding=1), 1


_FAMILY_CASES = {"attention": _attention_cases, "convolution": _convolution_cases}


def _forward_backward(forward: Callable[[], torch.Tensor], gradient: torch.Tensor) -> None:
    forward().backward(gradient)


def _family_rates(family: str, dtype: torch.dtype, kind: str, device: torch.device, env: DistEnv,
                  alone: bool) -> dict[str, list[list[float]]]:
    """{"forward", "backward": [[FLOPs per unit, FLOP/s], ...]} of one of
    dispatched_work.KERNEL_FAMILIES, at its cases' shapes (module docstring)."""
    curves: dict[str, list[list[float]]] = {"forward": [], "backward": []}
    for forward, units in _FAMILY_CASES[family](dtype, kind, device):
        gradient = torch.ones_like(forward())
        with Counting() as counter:
            forward().backward(gradient)
        flops = counter.work.family_flops_by_size[family]
        forward_s = seconds_per_call(forward, device, env, alone, KERNEL_ITERS)
        both_s = seconds_per_call(functools.partial(_forward_backward, forward, gradient), device, env, alone,
                                  KERNEL_ITERS)
        for direction, seconds in (("forward", forward_s), ("backward", max(both_s - forward_s, both_s / 10))):
            total = sum(flops[direction].values())
            curves[direction].append([total / units, total / seconds])
    return curves


def _topk_rates(kind: str, device: torch.device, env: DistEnv, alone: bool) -> list[list[float]]:
    curve = []
    for size in TOPK_ELEMENTS[kind]:
        vector = torch.randn(size, generator=torch.Generator().manual_seed(0)).to(device)
        seconds = seconds_per_call(functools.partial(torch.topk, vector, size // 100, sorted=False), device, env,
                                   alone, KERNEL_ITERS)
        curve.append([size, size / seconds])
    return curve


def _optimizer_op_costs(rates: dict[str, Any], device: torch.device, env: DistEnv,
                        alone: bool) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """``optimizer_op_s`` (module docstring), with ``rates``' op cost and memory pricing
    already measured; and {optimizer: why} for those of the library's optimizers that could
    not be timed (bitsandbytes not installed, its kernels not loading on the device), whose
    sizes timed before the failure are dropped too."""
    remainders: dict[str, list[tuple[int, float]]] = {}
    unavailable: dict[str, str] = {}
    for name in sorted(optimizers.BITSANDBYTES - {"paged_adamw8bit"}):  # paged: adamw8bit's op, paged state
        timed: dict[str, list[tuple[int, float]]] = {}
        for elements in OPTIMIZER_OP_ELEMENTS[device.type]:
            probe = _optimizer_probe(name, elements, device, env)
            if isinstance(probe, str):
                unavailable[name] = probe
                break
            key, step, work = probe
            priced = work["ops"] * rates["op_s"]["fp32"] + memory_seconds(work, rates)
            timed.setdefault(key, []).append((elements, seconds_per_call(step, device, env, alone) - priced))
        else:
            for key, points in timed.items():
                remainders.setdefault(key, []).extend(points)
    return {key: _per_call_and_element(points) for key, points in remainders.items()}, unavailable


def _optimizer_probe(name: str, elements: int, device: torch.device,
                     env: DistEnv) -> tuple[str, Callable[[], Any], dict[str, Any]] | str:
    """(the op's key, a step of optimizer ``name`` on one parameter of ``elements``, what that
    step dispatches), or why it cannot be timed: the library not importing, its kernels not
    loading, a step that is not one library op. Every rank learns whether any failed before
    the timing's collectives, so one rank's failure cannot leave the others waiting."""
    why = ""
    try:
        param = torch.nn.Parameter(torch.ones(elements, device=device))
        param.grad = torch.full_like(param, 1e-3)
        optimizer = optimizers.make([param], name, lr=1e-3)
        work = counted_optimizer_step(optimizer)
        if len(work["optimizer_ops"]) != 1:
            why = f"one step on one parameter dispatched {work['optimizer_ops'] or 'no library op'}"
    except (ImportError, RuntimeError) as error:
        why = f"{type(error).__name__}: {error}".splitlines()[0]
    failed = torch.tensor([1.0 if why else 0.0], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        return why or "another rank could not step it"
    (key, _), = work["optimizer_ops"].items()
    return key, optimizer.step, work


def _per_call_and_element(points: list[tuple[int, float]]) -> dict[str, float]:
    """{"call_s", "element_s"}: the least-squares line through (elements, seconds), neither
    part below zero (a line through the origin where the intercept would be)."""
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread) if spread else 0.0
    if mean_y - slope * mean_x < 0:
        return {"call_s": 0.0, "element_s": max(0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points))}
    return {"call_s": mean_y - slope * mean_x, "element_s": slope}


def _stream(vectors: dict[int, list[torch.Tensor]], device: torch.device, env: DistEnv,
            alone: bool) -> list[list[float]]:
    def add(size: int) -> float:
        a, b, out = vectors[size]
        # Small adds are microseconds: enough of them that a timing spans about a millisecond.
        iters = max(ITERS, min(1000, 2**18 // size))
        return seconds_per_call(lambda: torch.add(a, b, out=out), device, env, alone, iters)

    fixed = add(1)
    # A net time under a tenth of the call's is noise: such a size is cache-fast either way.
    return [[3 * size * 4, 3 * size * 4 / max(gross - fixed, gross / 10)]
            for size in vectors if size > 1 for gross in [add(size)]]


class _ElementwiseTiming(Counting):
    """Counting, and each op it counts into ``memory_bytes`` timed inside its call: ``calls``
    and ``seconds()`` summed over them. On CUDA by a pair of events around the op (its
    kernel's time on the stream; a synchronisation around each op would time the launch's
    latency instead), on the CPU by the clock."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.on_cuda = device.type == "cuda"
        self.calls, self._seconds = 0, 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self.on_cuda:
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
            out = func(*args, **(kwargs or {}))
            events[1].record()
        else:
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            elapsed = time.perf_counter() - start
        counted = self.work.memory_bytes.total()
        self.work.add(func, args, kwargs or {}, out)
        if self.work.memory_bytes.total() != counted:
            self.calls += 1
            if self.on_cuda:
                self._events.append(events)
            else:
                self._seconds += elapsed
        return out

    def seconds(self) -> float:
        if self._events:
            torch.cuda.synchronize()
        return self._seconds + float(sum(start.elapsed_time(end) for start, end in self._events)) / 1e3


def _timed_call_s(device: torch.device) -> float:
    """What timing an op in place (_ElementwiseTiming) reads for an op that moves next to
    nothing, an add of one element: the fixed cost memory_factor takes off each timed op (op_s
    prices it), measured the same way; the median of REPEATS timings of ITERS × 20 calls."""
    a, b, out = (torch.ones(1, device=device) for _ in range(3))
    timings = []
    for _ in range(REPEATS):
        with _ElementwiseTiming(device) as timing:
            for _ in range(ITERS * 20):
                torch.add(a, b, out=out)
        timings.append(timing.seconds() / timing.calls)
    return float(statistics.median(timings))


def _memory_factor(steps: list[tuple[Callable[[], None], dict[str, Any]]], rates: dict[str, Any],
                   device: torch.device, env: DistEnv, alone: bool) -> list[list[float]]:
    """``memory_factor``, [[op size, factor], ...], one point for each fp32 step of ``steps``
    (module docstring) at its typical op size. The median of REPEATS steps; the slowest
    rank's, or rank 0's alone."""
    points = []
    for step, work in steps:
        stream = sum(t for _, t in _stream_seconds_by_size(work, rates))
        factors = []
        for _ in range(REPEATS):
            dist.barrier()
            if env.rank == 0 or not alone:
                call_s = _timed_call_s(device)
                with _ElementwiseTiming(device) as timing:
                    step()
                factors.append((timing.seconds() - timing.calls * call_s) / stream)
        factor = torch.tensor([statistics.median(factors) if factors else 0.0], dtype=torch.float64, device=device)
        dist.all_reduce(factor, op=dist.ReduceOp.MAX)
        # Never below 1: the STREAM add is the fastest the host moves bytes.
        points.append([_typical_op_size(work), max(1.0, float(factor.item()))])
    return sorted(points)


def _op_cost(seconds: float, work: dict[str, Any], rates: dict[str, Any], precision: str) -> float:
    """``op_s`` of one precision from its step at the fewer samples, which took ``seconds``
    (module docstring)."""
    kernels, memory = kernel_seconds(work, rates, precision), memory_seconds(work, rates)
    # Never below a tenth of the step, so noise cannot zero the op cost.
    return float(max(seconds - kernels - memory, seconds / 10) / work["ops"])


def _step_seconds(step: Callable[[], None], device: torch.device, env: DistEnv, alone: bool) -> float:
    # Up to 10 steps a timing where they are quick (a GPU's milliseconds), as many as fit in
    # SPAN_S where they are not (this CPU's ~10 ms: 5).
    return seconds_per_call(step, device, env, alone, iters=10)


def datasheet_efficiency(device: torch.device, matmul_flops_per_s: dict[str, float]) -> dict[str, Any]:
    """{"device_name", "datasheet_peak_flops_per_s", "matmul_efficiency"}: each precision's
    largest matmul rate as a fraction of the device's dense datasheet peak (measure/flops.py;
    fp32 the TF32 peak where this process's matmuls use TF32), which a plan priced at this
    run's rates states (predict/rough_time.py); {"no_datasheet_peak": why} for a device
    flops.py does not list (any CPU)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    matmul_precision = torch.get_float32_matmul_precision()
    peaks = {precision: flops.peak_flops(name, flops.compute_precision(precision, matmul_precision))
             for precision in matmul_flops_per_s}
    known = {precision: peak for precision, peak in peaks.items() if peak}
    if len(known) < len(peaks):
        return {"device_name": name, "no_datasheet_peak":
                f"measure/flops.py has no dense datasheet peak for {name or 'a ' + device.type + ' device'}"}
    return {"device_name": name, "datasheet_peak_flops_per_s": known,
            "matmul_efficiency": {precision: rate / known[precision] for precision, rate in matmul_flops_per_s.items()}}


def measure(env: DistEnv) -> dict[str, Any]:
    """The rates, {"concurrent": {...}, "alone": {...}}, each {"matmul_flops_per_s":
    {precision: FLOP/s}, "memory_bytes_per_s", "op_s" {precision: s}, "memory_factor",
    "optimizer_op_s", ...} (module docstring), "optimizer_op_unavailable" where an optimizer
    library's op could not be timed, and what was timed."""
    device, kind = env.device, env.device.type
    vectors = {size: [torch.ones(size, device=device) for _ in range(3)] for size in (1, *STREAM_ELEMENTS[kind])}
    decoder = models.PRESETS[OP_COST_MODEL]
    # Each precision's step at the fewer samples (op_s), and the two fp32 steps whose ops
    # memory_factor times.
    steps = {name: _model_step(decoder, device, name, OP_COST_SAMPLES[0]) for name in PRECISIONS}
    memory_steps = [_model_step(decoder, device, "fp32", OP_COST_SAMPLES[1]),
                    _model_step(OP_COST_WIDE, device, "fp32", 1)]
    rates: dict[str, Any] = {}
    # A rank with no others is alone either way: its concurrent rates are its alone ones.
    for scope in ("concurrent", "alone") if env.world_size > 1 else ("concurrent",):
        alone = scope == "alone"
        by_size = {name: _matmul_rates(dtype, kind, device, env, alone) for name, dtype in PRECISIONS.items()}
        rates[scope] = {"matmul_flops_per_s": {name: curve[-1][1] for name, curve in by_size.items()},
                        "matmul_flops_per_s_by_size": by_size,
                        **{f"{family}_flops_per_s_by_size":
                           {name: _family_rates(family, dtype, kind, device, env, alone)
                            for name, dtype in PRECISIONS.items()} for family in KERNEL_FAMILIES},
                        "topk_elements_per_s_by_size": _topk_rates(kind, device, env, alone),
                        "memory_bytes_per_s": _stream(vectors, device, env, alone)}
        rates[scope]["memory_factor"] = _memory_factor(memory_steps, rates[scope], device, env, alone)
        seconds = {key: _step_seconds(step, device, env, alone) for key, (step, _) in steps.items()}  # each once
        rates[scope]["op_s"] = {name: _op_cost(seconds[name], steps[name][1], rates[scope], name)
                                for name in PRECISIONS}
        rates[scope]["optimizer_op_s"], unavailable = _optimizer_op_costs(rates[scope], device, env, alone)
        if unavailable:
            rates["optimizer_op_unavailable"] = unavailable
    rates.setdefault("alone", rates["concurrent"])
    return {**rates, **datasheet_efficiency(device, rates["concurrent"]["matmul_flops_per_s"]),
            "matmul_size": MATMUL_SIZE[kind], "matmul_sizes": list(MATMUL_SIZES[kind]),
            "attention_shapes": [list(shape) for shape in ATTENTION_SHAPES[kind]],
            "convolution_shapes": [list(shape) for shape in CONVOLUTION_SHAPES[kind]],
            "attention_heads": ATTENTION_HEADS[kind],
            "op_cost_model": OP_COST_MODEL, "op_cost_samples": list(OP_COST_SAMPLES),
            "tiny_step_ops": {name: steps[name][1]["ops"] for name in PRECISIONS},
            "tiny_step_matmul_flops": {name: steps[name][1]["matmul_flops"] for name in PRECISIONS},
            "world_size": env.world_size}
