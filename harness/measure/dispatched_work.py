"""What a training step dispatches, counted op by op: the work the step-time predictor
(harness/predict/step_time.py) prices, and what its calibration step did
(measure/compute_rate.py).

The traced step (harness/predict/traced.py) runs the cell's real code under FakeTensorMode,
so every aten op the engines issue reaches the fake mode with its shapes: forward,
backward, recomputation, the optimizer, the engines' own copies and casts, and the
collectives. Per op the counter adds:

- one to ``ops`` (what each op costs to dispatch, whatever its size);
- its FLOPs where torch's own FLOP formulas know the op (``torch.utils.flop_counter``:
  the matmuls, convolutions and attention kernels, forward and backward) to ``matmul_flops``,
  and by the call's FLOPs rounded up to a power of two to ``matmul_flops_by_size`` (a small
  matmul runs far below a large one's rate, so each size is priced at the rate measured for
  it);
- otherwise the bytes of its tensor inputs and outputs to ``memory_bytes``, by the op's
  size rounded up to a power of two (an elementwise op reads and writes memory at the
  bandwidth of the level of cache or memory its tensors fit in, so each size is priced at the
  rate measured for it), except for views, which move nothing;
- a collective (measure/comm.py's kinds and byte convention) to ``collectives``: per kind,
  how many calls of each size, so each call can be priced at the bandwidth the run's own
  sweep measured for that collective and size.

Queries of a fake tensor's metadata (``prim.device``: every ``t.device`` in Python) reach the
fake mode as ops but dispatch no kernel in the real step, and are not counted.

What the fake mode does not see costs nothing here: Python between ops (hooks, the engines'
bookkeeping), waiting for other ranks, and ops on other threads.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from harness.measure import comm


def dispatches_a_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether an op reaching a dispatch mode is work: ``prim`` ops are metadata queries
    (every ``t.device`` in Python), which dispatch no kernel."""
    return func.namespace != "prim"


def op_flops(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float | None:
    """The op's FLOPs by torch's own formulas (matmuls, convolutions, attention kernels), or
    None for an op they do not cover."""
    formula = flop_registry.get(func.overloadpacket)
    return None if formula is None else float(formula(*args, **kwargs, out_val=out))


@dataclasses.dataclass
class DispatchedWork:
    ops: int = 0
    matmul_flops: float = 0.0
    matmul_flops_by_size: Counter[int] = dataclasses.field(default_factory=Counter)  # call FLOPs (power of 2) -> FLOPs
    memory_bytes: Counter[int] = dataclasses.field(default_factory=Counter)  # op size (power of 2) -> bytes
    collectives: defaultdict[str, Counter[int]] = dataclasses.field(default_factory=lambda: defaultdict(Counter))

    def add(self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if not dispatches_a_kernel(func):
            return
        self.ops += 1
        call = comm.collective_call(func, args, out)
        if call is not None:
            kind, nbytes, _ = call
            self.collectives[kind][nbytes] += 1
            return
        flops = op_flops(func, args, kwargs, out)
        if flops is not None:
            self.matmul_flops += flops
            if flops:
                self.matmul_flops_by_size[_power_of_two_above(flops)] += int(flops)
        elif not func.is_view:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            nbytes = sum(t.nbytes for t in tensors)
            if nbytes:
                self.memory_bytes[_power_of_two_above(nbytes)] += nbytes

    def to_dict(self) -> dict[str, Any]:
        """The trace record's ``work``: ``matmul_flops_by_size`` as [[call FLOPs, FLOPs], ...],
        ``memory_bytes`` as [[op size, bytes], ...] and collectives as {kind: [[bytes per
        call, calls], ...]}, each sorted by size."""
        return {"ops": self.ops, "matmul_flops": self.matmul_flops,
                "matmul_flops_by_size": _pairs(self.matmul_flops_by_size), "memory_bytes": _pairs(self.memory_bytes),
                "collectives": {kind: _pairs(sizes) for kind, sizes in self.collectives.items()}}


def _power_of_two_above(amount: float) -> int:
    return 1 << (math.ceil(amount) - 1).bit_length()


def _pairs(counter: Counter[int]) -> list[list[Any]]:
    return [[size, n] for size, n in sorted(counter.items())]


class Counting(TorchDispatchMode):
    """Runs every op as it is and counts it into ``work``: a real step's dispatched work (the
    traced step counts inside its fake mode instead, one dispatch layer fewer)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.work = DispatchedWork()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.work.add(func, args, kwargs or {}, out)
        return out
