"""What a training step dispatches, counted op by op: the work the step-time predictor
(harness/predict/step_time.py) prices, and what its calibration step did
(measure/compute_rate.py).

The traced step (harness/predict/traced.py) runs the cell's real code under FakeTensorMode,
so every aten op the engines issue reaches the fake mode with its shapes: forward,
backward, recomputation, the optimizer, the engines' own copies and casts, and the
collectives. Per op the counter adds:

- one to ``ops`` (what each op costs to dispatch, whatever its size);
- its FLOPs where torch's own FLOP formulas know the op (``torch.utils.flop_counter``:
  the matmuls, convolutions and attention kernels, forward and backward; the CPU's flash
  attention kernels, which the registry lacks, by its SDPA formulas) to ``matmul_flops``, and
  by size, for the predictor prices each size at the rate measured for it:
  - a matmul's by the call's FLOPs rounded up to a power of two to ``matmul_flops_by_size``
    (a small matmul runs far below a large one's rate);
  - a family's of kernels that run at rates of their own (``KERNEL_FAMILIES``), forward and
    backward apart, to ``<family>_flops_by_size``: attention by its FLOPs per (sample, head)
    (the kernels loop over samples and heads; each head's sequence and width set the rate:
    on a CPU a bf16 step's flash attention backward runs at a hundredth of a bf16 matmul's
    rate at a small model's sizes), convolutions by the call's FLOPs (a small convnet's run
    at half a matmul's rate of the same FLOPs);
- a top-k selection's input elements, by their count rounded up to a power of two, to
  ``topk_elements_by_size`` (gradient sparsification's selection: a partial sort, thirty
  times slower per byte than an elementwise op on this project's CPU host, priced at the
  rate measured for it);
- an optimizer's whole update as one op of its library's (bitsandbytes' ``optimizer_update_*``:
  one call per parameter tensor, ``optimizer_op_key``), its call and its elements to
  ``optimizer_ops``, by op and optimizer, besides its bytes below: on the CPU such a call
  costs a tenth of a millisecond and 20 ns an element beyond the bytes it moves (block-wise
  8-bit Adam, timed on this project's host), priced at the costs measured for it;
- otherwise the bytes of its tensor inputs and outputs to ``memory_bytes``, by the op's
  size rounded up to a power of two (an elementwise op reads and writes memory at the
  bandwidth of the level of cache or memory its tensors fit in, so each size is priced at the
  rate measured for it), except for views and the ops that only allocate or relabel
  (``MOVES_NOTHING``: ``_unsafe_view``, the reshape of every batched matmul's output, was a
  tenth of a llama-tiny step's counted bytes), which move nothing;
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
import functools
import inspect
import math
from collections import Counter, defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from harness.features import optimizers
from harness.measure import comm

# Not views by their schemas, but they write no element: an allocation whose contents are
# undefined, and ``_unsafe_view``, a view autograd does not track as one.
MOVES_NOTHING = frozenset({torch.ops.aten._unsafe_view, torch.ops.aten.empty, torch.ops.aten.empty_like,
                           torch.ops.aten.empty_strided, torch.ops.aten.empty_permuted, torch.ops.aten.new_empty,
                           torch.ops.aten.new_empty_strided})


def dispatches_a_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether an op reaching a dispatch mode is work: ``prim`` ops are metadata queries
    (every ``t.device`` in Python), which dispatch no kernel."""
    return func.namespace != "prim"


def _cpu_flash_attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                               **kwargs: Any) -> int:
    return int(sdpa_flop_count(query.shape, key.shape, value.shape))


def _cpu_flash_attention_backward_flops(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                        value: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))


_FLOP_FORMULAS = {**flop_registry,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
                      _cpu_flash_attention_backward_flops}


def op_flops(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float | None:
    """The op's FLOPs by torch's own formulas (matmuls, convolutions, attention kernels; the
    CPU's flash attention by SDPA's), or None for an op they do not cover."""
    formula = _FLOP_FORMULAS.get(func.overloadpacket)
    return None if formula is None else float(formula(*args, **kwargs, out_val=out))


KERNEL_FAMILIES = ("attention", "convolution")


def kernel_family(func: torch._ops.OpOverload, args: tuple[Any, ...]) -> tuple[str, int] | None:
    """The KERNEL_FAMILIES member an op with FLOPs belongs to and how many units its call
    covers (its FLOPs are keyed per unit), or None for a matmul. An attention call's units are
    its (sample, head) pairs: its first tensor (the query, or the output's gradient) is [batch,
    heads, sequence, width] for SDPA's kernels and [batch, sequence, heads, width] for the flash
    and memory-efficient kernels beneath them. A convolution's call is its unit."""
    name = func.overloadpacket.__name__
    if "attention" in name:
        first = next(a for a in args if isinstance(a, torch.Tensor))
        return "attention", int(first.shape[0] * first.shape[1 if name.startswith("_scaled_dot_product") else 2])
    if "convolution" in name:
        return "convolution", 1
    return None


def optimizer_op_key(func: torch._ops.OpOverload, args: tuple[Any, ...]) -> str | None:
    """``"<op>/<optimizer>"`` for an op that is a whole optimizer update of its library's
    (bitsandbytes' ``optimizer_update_32bit`` and ``optimizer_update_8bit_blockwise``, whose
    first argument names the update: adam, lamb, ...), else None."""
    if func.namespace == "bitsandbytes" and func.overloadpacket.__name__.startswith("optimizer_update"):
        return f"{func.overloadpacket.__name__}/{args[0]}"
    return None


def _direction(func: torch._ops.OpOverload) -> str:
    return "backward" if "backward" in func.overloadpacket.__name__ else "forward"


@dataclasses.dataclass
class DispatchedWork:
    ops: int = 0
    matmul_flops: float = 0.0
    matmul_flops_by_size: Counter[int] = dataclasses.field(default_factory=Counter)  # call FLOPs (power of 2) -> FLOPs
    # family -> "forward" or "backward" -> FLOPs per unit (power of 2) -> FLOPs
    family_flops_by_size: defaultdict[str, defaultdict[str, Counter[int]]] = dataclasses.field(
        default_factory=lambda: defaultdict(lambda: defaultdict(Counter)))
    # elements (power of 2) -> elements
    topk_elements_by_size: Counter[int] = dataclasses.field(default_factory=Counter)
    memory_bytes: Counter[int] = dataclasses.field(default_factory=Counter)  # op size (power of 2) -> bytes
    # optimizer_op_key -> [calls, elements]
    optimizer_ops: defaultdict[str, list[int]] = dataclasses.field(default_factory=lambda: defaultdict(lambda: [0, 0]))
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
        if func.overloadpacket is torch.ops.aten.topk:
            elements = args[0].numel()
            self.topk_elements_by_size[_power_of_two_above(elements)] += elements
            return
        flops = op_flops(func, args, kwargs, out)
        if flops is not None:
            self.matmul_flops += flops
            family = kernel_family(func, args)
            if flops and family:
                name, units = family
                self.family_flops_by_size[name][_direction(func)][_power_of_two_above(flops / units)] += int(flops)
            elif flops:
                self.matmul_flops_by_size[_power_of_two_above(flops)] += int(flops)
        elif not func.is_view and func.overloadpacket not in MOVES_NOTHING:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            nbytes = sum(t.nbytes for t in tensors)
            if nbytes:
                self.memory_bytes[_power_of_two_above(nbytes)] += nbytes
            key = optimizer_op_key(func, args)
            if key is not None:
                self.optimizer_ops[key][0] += 1
                self.optimizer_ops[key][1] += tensors[0].numel()

    def to_dict(self) -> dict[str, Any]:
        """The trace record's ``work``: ``matmul_flops_by_size`` as [[call FLOPs, FLOPs], ...],
        ``<family>_flops_by_size`` for each of KERNEL_FAMILIES as {direction: [[FLOPs per
        unit, FLOPs], ...]}, ``topk_elements_by_size`` as [[elements a call, elements], ...], ``memory_bytes`` as
        [[op size, bytes], ...], ``optimizer_ops`` as {optimizer_op_key: [calls, elements]} and
        collectives as {kind: [[bytes per call, calls], ...]}, each sorted by size."""
        return {"ops": self.ops, "matmul_flops": self.matmul_flops,
                "matmul_flops_by_size": _pairs(self.matmul_flops_by_size),
                **{f"{name}_flops_by_size": {way: _pairs(sizes) for way, sizes in by_direction.items()}
                   for name in KERNEL_FAMILIES for by_direction in [self.family_flops_by_size[name]]},
                "topk_elements_by_size": _pairs(self.topk_elements_by_size),
                "memory_bytes": _pairs(self.memory_bytes),
                "optimizer_ops": {key: list(counts) for key, counts in sorted(self.optimizer_ops.items())},
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


# 65,536 elements: above bitsandbytes' min_8bit_size (4,096), so its 8-bit state applies.
OPTIMIZER_PROBE_SHAPE = (256, 256)


@functools.cache
def optimizer_step_work(name: str, device_type: str) -> dict[str, float]:
    """{"ops", "bytes_per_element"}: one step of optimizer ``name`` (features/optimizers.py)
    on one fp32 parameter tensor, counted by running its second step (the first made its
    state) on a CPU tensor of ``OPTIMIZER_PROBE_SHAPE`` with the implementation torch picks on
    ``device_type``: on CUDA torch.optim's multi-tensor ``foreach`` kernels, its default there;
    on the CPU the per-tensor loop (AdamW: 84 bytes an element against the fused kernel's 28,
    reading p, g, m, v and writing p, m, v once). bitsandbytes' optimizers are one fused op of
    theirs on either device, counted by its operands."""
    cls, kwargs = optimizers.optimizer_class_and_kwargs(name, lr=1e-3)
    if device_type == "cuda" and "foreach" in inspect.signature(cls).parameters:
        kwargs = {**kwargs, "foreach": True}
    param = torch.nn.Parameter(torch.ones(OPTIMIZER_PROBE_SHAPE))
    param.grad = torch.full_like(param, 1e-3)
    work = counted_optimizer_step(cls([param], **kwargs))
    return {"ops": work["ops"], "bytes_per_element": sum(nbytes for _, nbytes in work["memory_bytes"]) / param.numel()}


def counted_optimizer_step(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What one step of ``optimizer`` dispatches (DispatchedWork.to_dict), counted on its
    second step: the first makes its state, as a timed step finds it. Its parameters hold
    their gradients."""
    optimizer.step()
    counting = Counting()
    with counting:
        optimizer.step()
    return counting.work.to_dict()
