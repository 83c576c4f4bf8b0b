"""The work of a planned step, for pricing at a run's own rates (``plan --calibration``): each
configuration's step traced at one block and at two (harness/predict/traced.py: the real
engines under FakeTensorMode at the plan's world size, a second or so where the whole model's
trace can take minutes) and extrapolated to the model's depth, block by block. Every op
count, FLOP size class, kernel family and byte size class of the step grows by the second
block's increment for each further block: exact for a model of identical blocks (gpt2-124m's
fp32 step at 256 tokens, traced whole and from 1 and 2 blocks: the same ops, FLOPs and bytes).
A model no deeper than that is traced whole, once.

A collective kind's calls grow the same way in number and in bytes, the bytes spread evenly
over the calls: a bucketed engine's call sizes are not linear in depth (DDP fills 25 MB
buckets, two blocks of a real model a few), their count and their sum are (every engine here
moves bytes in proportion to the parameters, or to the activations, of each block).

Configurations that dispatch alike on the device share their traces: activation offload
recomputes nothing (traced as no checkpointing; step_time prices its copies), and offload
moves the optimizer's step to the host (traced without offload; the optimizer's device
traffic, its own counted step over the elements the rank steps, is taken out, and step_time
prices the host's step and the copies).

At datasheet rates plan prices the analytic FLOPs instead: the assumed MFU stands for every
kernel of the step (predict/rough_time.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from harness.config import CellSpec
from harness.measure import dispatched_work
from harness.measure.dispatched_work import KERNEL_FAMILIES
from harness.models import sources
from harness.predict import analytic, step_time

Trace = Callable[[list[CellSpec]], dict[str, dict]]
DEPTHS = (1, 2)


def stand_ins(cells: list[CellSpec], trace: Trace, device_type: str, nodes: int = 1) -> dict[str, dict]:
    """cell_id -> what step_time.predict takes as the cell's trace on ``device_type``: its
    extrapolated work as a stand-in (module docstring), or {"unavailable": why} where a
    shallow trace failed or the model's depth cannot change (step_time then prices the
    analytic work)."""
    shallow: dict[str, tuple[CellSpec, ...]] = {}
    problems: dict[str, str] = {}
    for cell in cells:
        n_layers = cell.model_spec.n_layers
        at = DEPTHS if n_layers > DEPTHS[-1] else (n_layers,)  # whole: nothing to extrapolate
        try:
            shallow[cell.cell_id] = tuple(_at_depth(_traced_as(cell), k) for k in at)
        except ValueError as error:
            problems[cell.cell_id] = str(error)
    distinct = {c.cell_id: c for pair in shallow.values() for c in pair}
    traced = trace(list(distinct.values()))
    results: dict[str, dict] = {}
    for cell in cells:
        if cell.cell_id in problems:
            results[cell.cell_id] = {"unavailable": f"planned; its blocks cannot be traced apart:"
                                                    f" {problems[cell.cell_id]}"}
            continue
        at_depths = [traced[c.cell_id] for c in shallow[cell.cell_id]]
        depths = [c.model_spec.n_layers for c in shallow[cell.cell_id]]
        if any("work" not in t for t in at_depths):
            why = next(t["unavailable"] for t in at_depths if "work" not in t)
            results[cell.cell_id] = {"unavailable": f"planned; its trace at {tuple(depths)} blocks: {why}"}
            continue
        n_layers = cell.model_spec.n_layers
        whole = len(at_depths) == 1
        work = at_depths[0]["work"] if whole else extrapolated(at_depths[0]["work"], at_depths[1]["work"], n_layers)
        how = (f"traced whole ({n_layers} blocks)" if whole
               else f"traced at {depths[0]} and {depths[1]} of its {n_layers} blocks, extrapolated")
        results[cell.cell_id] = {
            "unavailable": f"planned: {how}",
            "stand_in": {"cell_id": shallow[cell.cell_id][-1].cell_id, "strategy": cell.strategy.name,
                         "work": _without_offloaded_optimizer(cell, work, device_type, nodes)}}
    return results


def _traced_as(cell: CellSpec) -> CellSpec:
    """The configuration whose device work ``cell``'s is: without offload, and activation
    offload as no checkpointing."""
    s = cell.strategy
    strategy = dataclasses.replace(s, offload="none",
                                   checkpointing="none" if s.checkpointing == "offload" else s.checkpointing)
    return dataclasses.replace(cell, strategy=strategy)


def _at_depth(cell: CellSpec, n_layers: int) -> CellSpec:
    return dataclasses.replace(cell, model=sources.at_depth(cell.model_spec, n_layers))


def extrapolated(one: dict, two: dict, n_layers: int) -> dict:
    """The work of ``n_layers`` blocks from the work of one (``one``) and of two (``two``), in
    dispatched_work's format (module docstring)."""

    def grown(a: float, b: float) -> float:
        return max(0.0, a + (n_layers - 1) * (b - a))

    def by_size(a: list, b: list) -> list[list[float]]:
        at_one, at_two = dict(a), dict(b)
        return [[size, grown(at_one.get(size, 0.0), at_two.get(size, 0.0))] for size in sorted({*at_one, *at_two})]

    ops_one, ops_two = one.get("optimizer_ops", {}), two.get("optimizer_ops", {})  # {key: [calls, elements]}
    work = {"ops": grown(one["ops"], two["ops"]), "matmul_flops": grown(one["matmul_flops"], two["matmul_flops"]),
            "matmul_flops_by_size": by_size(one["matmul_flops_by_size"], two["matmul_flops_by_size"]),
            "topk_elements_by_size": by_size(one["topk_elements_by_size"], two["topk_elements_by_size"]),
            "memory_bytes": by_size(one["memory_bytes"], two["memory_bytes"]),
            "optimizer_ops": {key: [grown(a, b) for a, b in zip(ops_one.get(key, (0, 0)), ops_two.get(key, (0, 0)))]
                              for key in sorted({*ops_one, *ops_two})},
            "collectives": {kind: _calls(one["collectives"].get(kind, []), two["collectives"].get(kind, []), grown)
                            for kind in sorted({*one["collectives"], *two["collectives"]})}}
    for family in KERNEL_FAMILIES:
        a, b = one[f"{family}_flops_by_size"], two[f"{family}_flops_by_size"]
        work[f"{family}_flops_by_size"] = {direction: by_size(a.get(direction, []), b.get(direction, []))
                                           for direction in sorted({*a, *b})}
    return work


def _calls(one: list, two: list, grown: Callable[[float, float], float]) -> list[list[float]]:
    """One collective kind's calls at the model's depth, as [[bytes a call, calls]]: its call
    count and its bytes each grown block by block, the bytes spread evenly over the calls (a
    bucketed engine's calls differ in size, and which sizes grow with depth does not
    extrapolate; their count and their sum do)."""
    calls = grown(sum(n for _, n in one), sum(n for _, n in two))
    nbytes = grown(sum(size * n for size, n in one), sum(size * n for size, n in two))
    return [[nbytes / calls, calls]] if calls >= 1 and nbytes > 0 else []


def _without_offloaded_optimizer(cell: CellSpec, work: dict, device_type: str, nodes: int) -> dict:
    """``work`` (traced without offload) less the optimizer's device traffic where ``cell``
    offloads it to a GPU's host: the traced step's optimizer (the CPU's implementation:
    the trace runs the CPU step) over the elements the traced configuration's rank steps,
    taken from every op size alike (a first-order split: the trace does not say which bytes
    were the optimizer's)."""
    if device_type != "cuda" or step_time.optimizer_elements(cell, analytic.predict(cell, nodes=nodes)) > 0:
        return work  # a CPU host steps an offloaded optimizer on the cores it computes on
    base = _traced_as(cell)
    steps = step_time.optimizer_elements(base, analytic.predict(base, nodes=nodes))
    removed = steps * dispatched_work.optimizer_step_work(cell.strategy.optimizer, "cpu")["bytes_per_element"]
    total = sum(nbytes for _, nbytes in work["memory_bytes"])
    keep = max(0.0, total - removed) / total if total else 1.0
    return {**work, "memory_bytes": [[size, nbytes * keep] for size, nbytes in work["memory_bytes"]]}
