"""How fast the run's ranks compute, measured once per run in the bandwidth sweep's launch
(harness/measure/bandwidth.py ``main``): the rates the step-time predictor
(harness/predict/step_time.py) prices a step's dispatched work at.

Three rates, each timed on every rank at once (the ranks share the host's cores and memory
bus as a cell's ranks do; the slowest rank's time is kept) and again on rank 0 alone while
the others wait (as the single-process reference runs):

- ``matmul_flops_per_s``, per precision: a square matmul of ``MATMUL_SIZE`` (CPU: 512, one
  thread's tile-friendly size; CUDA: 8192, large enough to reach the tensor cores' rate),
  2·n³ FLOPs a call.
- ``memory_bytes_per_s``: [[working set, bytes/s], ...], an out-of-place add of two fp32
  vectors (STREAM's "add": three vectors' bytes a call, the working set) at each of
  ``STREAM_ELEMENTS``, from a first-level cache's size to beyond any last-level cache's: an
  op's bandwidth depends on where its tensors fit. The time of the same add on one element
  (the call's fixed cost, which ``op_s`` prices) is taken off each timing first.
- ``op_s``, per precision: one dispatched op's cost, whatever its size: a training step of
  a transformers decoder at the tiny preset's sizes (``OP_COST_MODEL``: 2 layers of width 64,
  32 tokens; forward, backward and AdamW; bf16 and fp16 under autocast, as the cells run
  them), its matmuls' time (their FLOPs, counted by torch's formulas, at the matmul rate just
  measured: a few percent of the step in fp32, most of it in fp16 on a CPU without fp16
  units) taken off, divided by the aten ops it dispatches (both counted once, by a dispatch
  mode over one step). What is left is dispatch, autocast's and autograd's bookkeeping and
  the Python of transformers' modules around each op: 11-14 µs an op in fp32 on this
  project's hosts, where a plain Sequential of Linear, LayerNorm and GELU modules (an op per
  module call) costs 5-6 µs, under half of what the models' steps take. The engines' own
  hooks are not in it.

Each is the median of ``REPEATS`` timings of ``ITERS`` calls after ``WARMUP`` untimed ones.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from harness import models
from harness.distributed import DistEnv

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MATMUL_SIZE = {"cpu": 512, "cuda": 8192}
STREAM_ELEMENTS = {"cpu": tuple(2**k for k in range(10, 25, 3)), "cuda": tuple(2**k for k in range(16, 29, 3))}
WARMUP, ITERS, REPEATS = 2, 5, 5
OP_COST_MODEL = "llama-tiny"
SLOW_CALL_S = 0.05


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds_per_call(call: Callable[[], Any], device: torch.device, env: DistEnv, alone: bool,
                      iters: int = ITERS) -> float:
    """The median over REPEATS of (``iters`` calls' span ÷ ``iters``); the slowest rank's, or
    with ``alone`` rank 0's while the other ranks wait at a barrier. A call that takes longer
    than ``SLOW_CALL_S`` (an fp16 or bf16 matmul on a CPU without units for it: a tenth of a
    second and more) is timed once a repeat after one warm-up call: its span needs no
    averaging, and the calibration stays seconds long."""
    runs = env.rank == 0 or not alone
    timings = []
    if runs:
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        if time.perf_counter() - start > SLOW_CALL_S:
            iters = 1
    warmup = min(WARMUP, iters)
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


def dispatches_a_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether an op reaching a dispatch mode is work: ``prim`` ops are metadata queries
    (every ``t.device`` in Python), which dispatch no kernel."""
    return func.namespace != "prim"


def op_flops(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float | None:
    """The op's FLOPs by torch's own formulas (matmuls, convolutions, attention kernels), or
    None for an op they do not cover."""
    formula = flop_registry.get(func.overloadpacket)
    return None if formula is None else float(formula(*args, **kwargs, out_val=out))


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.ops = 0
        self.matmul_flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.ops += dispatches_a_kernel(func)
        self.matmul_flops += op_flops(func, args, kwargs or {}, out) or 0.0
        return out


def _tiny_step(device: torch.device, precision: str) -> tuple[Callable[[], None], _OpCount]:
    """A training step of ``OP_COST_MODEL`` at ``precision``, and what one step dispatches."""
    built = models.build(models.PRESETS[OP_COST_MODEL])
    model = built.module.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {name: t.to(device) for name, t in built.make_batch(torch.Generator().manual_seed(0), 2).items()}
    dtype = PRECISIONS[precision]

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = built.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists before the counted step, as in a timed one
    with _OpCount() as counter:
        step()
    return step, counter


def _stream(vectors: dict[int, list[torch.Tensor]], device: torch.device, env: DistEnv,
            alone: bool) -> list[list[float]]:
    def add(size: int) -> float:
        a, b, out = vectors[size]
        # Small adds are microseconds: enough of them that a timing spans about a millisecond.
        iters = max(ITERS, min(1000, 2**18 // size))
        return _seconds_per_call(lambda: torch.add(a, b, out=out), device, env, alone, iters)

    fixed = add(1)
    # A net time under a tenth of the call's is noise: such a size is cache-fast either way.
    return [[3 * size * 4, 3 * size * 4 / max(gross - fixed, gross / 10)]
            for size in vectors if size > 1 for gross in [add(size)]]


def measure(env: DistEnv) -> dict[str, Any]:
    """The rates, {"concurrent": {...}, "alone": {...}}, each {"matmul_flops_per_s":
    {precision: FLOP/s}, "memory_bytes_per_s", "op_s" {precision: s}}, and what was timed."""
    device, kind = env.device, env.device.type
    n = MATMUL_SIZE[kind]
    vectors = {size: [torch.ones(size, device=device) for _ in range(3)] for size in (1, *STREAM_ELEMENTS[kind])}
    steps = {name: _tiny_step(device, name) for name in PRECISIONS}
    matrices = {name: (torch.ones(n, n, dtype=dtype, device=device), torch.ones(n, n, dtype=dtype, device=device))
                for name, dtype in PRECISIONS.items()}
    rates: dict[str, Any] = {}
    for scope in ("concurrent", "alone"):
        alone = scope == "alone"
        matmul = {name: 2 * n**3 / _seconds_per_call(functools.partial(torch.mm, x, y), device, env, alone)
                  for name, (x, y) in matrices.items()}
        op_s = {}
        for name, (step, counted) in steps.items():
            # Steps of ~10 ms: 10 of them a timing, so one pre-emption does not set the rate.
            seconds = _seconds_per_call(step, device, env, alone, iters=10)
            # Less the step's matmuls at the rate just measured (fp16's are slow on CPUs
            # without fp16 units); never below a tenth of the step, so noise cannot zero it.
            op_s[name] = max(seconds - counted.matmul_flops / matmul[name], seconds / 10) / counted.ops
        rates[scope] = {"matmul_flops_per_s": matmul, "memory_bytes_per_s": _stream(vectors, device, env, alone),
                        "op_s": op_s}
    return {**rates, "matmul_size": n, "op_cost_model": OP_COST_MODEL,
            "tiny_step_ops": {name: counted.ops for name, (_, counted) in steps.items()},
            "tiny_step_matmul_flops": {name: counted.matmul_flops for name, (_, counted) in steps.items()},
            "world_size": env.world_size}
