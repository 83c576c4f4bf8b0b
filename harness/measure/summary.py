"""From every rank's raw numbers to a cell's metrics: the one place where "peak memory",
"step time" and "throughput" are defined.

- peak_mem_bytes: the max over ranks of each rank's peak (never a sum across ranks); the
  breakdown is that of the rank with the peak.
- at_optimizer_step_bytes: what a rank held, by category, when the optimizer step began
  (gradients reduced, activations freed): the measured counterpart of the ZeRO model-state
  formulas. Every rank holds the same states, but a rank can still hold a communication
  buffer in flight (FSDP2 with gloo: the root unit's reduce-scatter input, on one rank in
  some runs and not others), so this is the rank holding the least; per_rank has each. A
  pipeline's ranks hold different stages by design: there it is the rank with the peak's,
  as the analytic model's states are its heaviest rank's.
- async_freed_bytes: the most any rank freed on another thread during its memory step
  (measure/memory.py): how far peak_mem_bytes can move from run to run; 0: it cannot.
- step_time_s: the median over timed steps of the slowest rank's time in each step (the job
  waits for it at every step), every rank starting each step together (measure/timing.py);
  step_time_iqr_s the inter-quartile range of the same series.
- samples_per_s, tokens_per_s: the whole job's (global batch ÷ step time).
- tflops_per_rank: model FLOPs (PaLM formula, no recomputation counted) per rank per second.
- mfu: only against a known peak for the detected device; None otherwise, never a guess.
  mfu_suspect is set when it exceeds 1: a measuring error, not a fast run.
- memory_growth_bytes: the most any rank's held memory grew from the first timed step to
  the last (harness/training.py, measure/memory.py ``live_bytes``); more than 0 is a leak: both
  measures (CUDA's allocator count, the CPU tensor bytes Python holds) stay put from step to
  step unless something is kept.
- comm_*: counted on rank 0's comm step; every rank runs the same collectives but in a
  pipeline, whose ranks send what their stages hand on (a middle rank both ways, twice
  the first's): there on the comm step of the rank that sent the most (the lowest of
  equals; comm_counted_rank says which), as the analytic model's are its busiest rank's.
  busbw_gbps
  per op by the nccl-tests factors (on gloo, time includes waiting for the peer).
  comm_exposed_s_per_step: the part of that step's collective time during which it computed
  nothing, and comm_overlap_fraction the rest's share (measure/overlap.py); None in records
  from before they were measured.
"""

from __future__ import annotations

from typing import Any

from harness.config import CellSpec
from harness.measure.comm import busbw_factor
from harness.measure.memory import BREAKDOWN_KEYS
from harness.measure.timing import median_iqr


def _with_busbw(comm_by_op: dict[str, dict[str, Any]], world_size: int) -> dict[str, dict[str, Any]]:
    out = {}
    for op, stats in comm_by_op.items():
        busbw = None
        if stats["time_s"] > 0 and not stats.get("unsized"):  # unsized calls: time without their bytes
            try:
                busbw = stats["bytes"] / stats["time_s"] * busbw_factor(op, world_size) / 1e9
            except ValueError:
                pass  # barrier, gather, scatter: nccl-tests defines no bus bandwidth for them
        out[op] = {**stats, "busbw_gbps": busbw}
    return out


def _at_optimizer_step(per_rank: list[dict[str, Any]]) -> dict[str, int] | None:
    held: list[dict[str, int]] = [r["at_optimizer_step_bytes"] for r in per_rank if r.get("at_optimizer_step_bytes")]
    return min(held, key=lambda b: sum(b.values())) if held else None


def memory_growth(per_rank: list[dict[str, Any]]) -> int | None:
    """The most any rank's held memory grew over the timed steps; None where unmeasured."""
    return max((r["memory_growth_bytes"] for r in per_rank if r.get("memory_growth_bytes") is not None), default=None)


def summarize(cell: CellSpec, per_rank: list[dict[str, Any]], peak_flops_per_rank: float | None) -> dict[str, Any]:
    peak_rank = max(per_rank, key=lambda r: r["peak_mem_bytes"])
    slowest_per_step = [max(times) for times in zip(*(r["step_times_s"] for r in per_rank))]
    step_time, step_iqr = median_iqr(slowest_per_step)
    samples_per_s = cell.global_batch / step_time
    rank0 = per_rank[0]
    # A pipeline's ranks hold and send their own stages' (module docstring): the states its
    # peak rank's, the communication its busiest rank's.
    if cell.strategy.pipelined:
        holding = [peak_rank]
        counted = max(per_rank, key=lambda r: sum(op["bytes"] for op in r["comm_by_op"].values()))
    else:
        holding, counted = per_rank, rank0
    flops_per_s_per_rank = rank0["flops_per_sample"] * samples_per_s / cell.world_size
    comm_by_op = _with_busbw(counted["comm_by_op"], cell.world_size)
    mfu = flops_per_s_per_rank / peak_flops_per_rank if peak_flops_per_rank else None
    return {
        "peak_mem_bytes": peak_rank["peak_mem_bytes"],
        "mem_breakdown_bytes": {k: peak_rank["mem_breakdown_bytes"][k] for k in BREAKDOWN_KEYS},
        "rss_peak_bytes": max((r["rss_peak_bytes"] or 0) for r in per_rank) or None,
        "at_optimizer_step_bytes": _at_optimizer_step(holding),
        "async_freed_bytes": max(r.get("async_freed_bytes", 0) for r in per_rank),
        "memory_growth_bytes": memory_growth(per_rank),
        "step_time_s": step_time,
        "step_time_iqr_s": step_iqr,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * rank0["tokens_per_sample"],
        "tflops_per_rank": flops_per_s_per_rank / 1e12,
        "mfu": mfu,
        "mfu_suspect": mfu is not None and mfu > 1.0,
        "comm_time_s_per_step": sum(op["time_s"] for op in comm_by_op.values()),
        "comm_bytes_per_step": sum(op["bytes"] for op in comm_by_op.values()),
        "comm_by_op": comm_by_op,
        "comm_counted_rank": counted["rank"],
        "comm_exposed_s_per_step": (counted.get("comm_exposure") or {}).get("exposed_s"),
        "comm_overlap_fraction": (counted.get("comm_exposure") or {}).get("overlap_fraction"),
    }


def per_rank_view(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-rank numbers a reader wants next to the maxima (no losses: they are global)."""
    rows = []
    for r in per_rank:
        median, iqr = median_iqr(r["step_times_s"])
        rows.append({
            "rank": r["rank"],
            "peak_mem_bytes": r["peak_mem_bytes"],
            "mem_breakdown_bytes": r["mem_breakdown_bytes"],
            "rss_peak_bytes": r["rss_peak_bytes"],
            "cuda_memory": r["cuda_memory"],
            "memory_tracker": r["memory_tracker"],
            "at_optimizer_step_bytes": r.get("at_optimizer_step_bytes"),
            "async_freed_bytes": r.get("async_freed_bytes"),
            "memory_growth_bytes": r.get("memory_growth_bytes"),
            "memory_growth_steps": r.get("memory_growth_steps"),
            "live_bytes_measure": r.get("live_bytes_measure"),
            "memory_timeline": r.get("memory_timeline"),
            "memory_snapshot": r.get("memory_snapshot"),
            "memory_snapshot_reason": r.get("memory_snapshot_reason"),
            "profile_trace": r.get("profile_trace"),
            "module_memory": r.get("module_memory"),
            "expandable_segments": r.get("expandable_segments"),
            "allocator_settings": r.get("allocator_settings"),
            "float32_matmul_precision": r.get("float32_matmul_precision"),
            "step_time_s": median,
            "step_time_iqr_s": iqr,
            "step_times_s": r["step_times_s"],
            "engine": r["engine"],
        })
    return rows
