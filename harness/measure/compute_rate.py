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
- ``op_s``, per precision: one dispatched op's cost, whatever its size: a training step of a
  small model (``_tiny_step``: Linear, LayerNorm and GELU blocks of width 16, forward,
  backward and AdamW; bf16 and fp16 under autocast, as the cells run them) timed and divided
  by the aten ops it dispatches (counted once, by a dispatch mode over one step). Tiny tensors
  make the matmuls and memory traffic negligible, so what is left is dispatch, autocast's and
  autograd's bookkeeping and the Python that calls each op (a transformers GPT-2 of width 16
  gave within 12 % of it in fp32 on this host).

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

from harness.distributed import DistEnv

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MATMUL_SIZE = {"cpu": 512, "cuda": 8192}
STREAM_ELEMENTS = {"cpu": tuple(2**k for k in range(10, 25, 3)), "cuda": tuple(2**k for k in range(16, 29, 3))}
WARMUP, ITERS, REPEATS = 2, 5, 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds_per_call(call: Callable[[], Any], device: torch.device, env: DistEnv, alone: bool,
                      iters: int = ITERS) -> float:
    """The median over REPEATS of (``iters`` calls' span ÷ ``iters``); the slowest rank's, or
    with ``alone`` rank 0's while the other ranks wait at a barrier."""
    runs = env.rank == 0 or not alone
    timings = []
    for _ in range(REPEATS):
        dist.barrier()
        if runs:
            for _ in range(WARMUP):
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


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _tiny_step(device: torch.device, precision: str) -> tuple[Callable[[], None], int]:
    """A small model's training step at ``precision``, and the aten ops one step dispatches."""
    torch.manual_seed(0)
    width = 16
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randn(8, width, device=device)

    dtype = PRECISIONS[precision]

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(batch).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists before the counted step, as in a timed one
    with _OpCount() as counter:
        step()
    return step, counter.ops


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
        rates[scope] = {
            "matmul_flops_per_s": {
                name: 2 * n**3 / _seconds_per_call(functools.partial(torch.mm, x, y), device, env, alone)
                for name, (x, y) in matrices.items()},
            "memory_bytes_per_s": _stream(vectors, device, env, alone),
            # Steps of ~2 ms: 40 of them a timing, so one pre-emption does not set the rate.
            "op_s": {name: _seconds_per_call(step, device, env, alone, iters=40) / ops
                     for name, (step, ops) in steps.items()},
        }
    return {**rates, "matmul_size": n, "tiny_step_ops": {name: ops for name, (_, ops) in steps.items()},
            "world_size": env.world_size}
