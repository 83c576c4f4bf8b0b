"""The run's calibration launch: one short torchrun of the run's ranks before its cells
(harness/runner/launcher.py ``run_bandwidth_sweep``), measuring what the step-time predictor
(harness/predict/step_time.py) prices a step at:

- the collective bandwidth sweep (measure/bandwidth.py), on two ranks or more (a one-rank
  launch records ``no_sweep``, why, and its compute rates alone);
- the ranks' compute rates (measure/compute_rate.py);
- each engine's own step (``engine_steps``): for every strategy the run's distributed cells
  use, a training step of compute_rate.OP_COST_MODEL under it (fp32, 2 samples a rank; the
  worker's own code, training.prepare_cell and PreparedCell.step), timed as the compute
  rates are (every rank at once; the median of compute_rate.REPEATS timings, the slowest
  rank's) after the strategy's own warm-up steps, with what one step dispatched counted
  (a pipeline's on its last rank and its busiest middle rank too, whose stages differ).
  What an engine does around its ops is no op the trace sees: DTensor's dispatch, FSDP's
  and DeepSpeed's hooks and bookkeeping, gloo's threads taking the cores from the step's ops
  while a collective is in flight. The predictor prices that as the part of this step's time
  its priced ops, sized work and collectives leave, spread over its ops (step_time's
  ``engine_overhead_per_op``).

Run as ``python -m torch.distributed.run ... -m harness.calibration --out FILE [--engines
ddp,fsdp_full,...]``: each node's local rank 0 writes the JSON (every rank holds the same rows,
the slowest rank's times; over several nodes global rank 0 may be on another node).
``--collectives-only`` leaves out the compute rates and the engines' steps: the sweep across
nodes (runner/session.py) runs after node 0's own, which measured them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from harness import strategies, training
from harness.config import CellSpec, StrategySpec
from harness.distributed import DistEnv, init_from_torchrun
from harness.measure import bandwidth, compute_rate
from harness.measure.dispatched_work import Counting
from harness.strategies import pipeline

ENGINE_STEP_SAMPLES = 2  # per rank: the default suite's micro-batch
ONE_RANK_NO_SWEEP = "a bandwidth sweep needs at least 2 ranks; this run has 1"


def engine_step_cell(name: str, world_size: int) -> CellSpec:
    """The cell whose step calibrates strategy ``name``'s engine: at its declared layout, or,
    where that needs more ranks than the launch has (tp_fsdp's two data-parallel groups of
    tp_degree ranks), at the tensor-parallel degree that leaves two groups: its DTensor
    dispatch and FSDP's hooks are the engine's at any degree (on 2 ranks, degree 1)."""
    def cell(strategy: StrategySpec) -> CellSpec:
        return CellSpec(model=compute_rate.OP_COST_MODEL, strategy=strategy, micro_batch=ENGINE_STEP_SAMPLES,
                        world_size=world_size)

    declared = StrategySpec(name=name)
    try:
        return cell(declared)
    except ValueError:
        if declared.tp_degree is None or world_size < 2:
            raise
        return cell(StrategySpec(name=name, tp_degree=world_size // 2))


def engine_steps(env: DistEnv, names: list[str]) -> dict[str, dict[str, Any]]:
    """{strategy: {"cell_id", "step_s", "work"[, "last_rank_work", "middle_rank_work"]} or
    {["cell_id",] "unavailable": why}} for each of ``names`` (module docstring). A strategy
    this launch cannot run (its world size, the device, a combination it refuses) is recorded
    with the reason and skipped on every rank."""
    steps: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            cell = engine_step_cell(name, env.world_size)
        except ValueError as error:  # a layout this world size cannot form
            steps[name] = {"unavailable": str(error)}
            continue
        why = strategies.incompatibility(cell) or strategies.unsupported_reason(cell, env.device.type)
        if why:
            steps[name] = {"cell_id": cell.cell_id, "unavailable": why}
            continue
        steps[name] = {"cell_id": cell.cell_id, **_timed_step(training.prepare_cell(cell, env), env)}
        gc.collect()
    return steps


def _timed_step(session: training.PreparedCell, env: DistEnv) -> dict[str, Any]:
    """{"step_s", "work"} of a prepared cell's step, after its own warm-up steps (DDP's
    rebuilt buckets, DeepSpeed ZeRO-3's recorded fetch order), rank 0's work, and a
    pipeline's other ranks' (``_pipeline_rank_work``)."""
    done = 0

    def step() -> None:
        nonlocal done
        session.step(done % len(session.batches))
        done += 1

    for _ in range(session.cell.warmup_steps):
        step()
    with Counting() as counter:
        step()
    work = counter.work.to_dict()
    other_ranks = _pipeline_rank_work(session.cell, work) if session.cell.strategy.pipelined else {}
    return {"step_s": compute_rate.seconds_per_call(step, env.device, env, alone=False), "work": work, **other_ranks}


def _pipeline_rank_work(cell: CellSpec, work: dict[str, Any]) -> dict[str, Any]:
    """The pipeline ranks' work step_time prices besides rank 0's (pipeline.other_ranks_work):
    the last rank's and, on more than two ranks, the busiest middle rank's."""
    every_rank: list[dict[str, Any]] = [{}] * cell.world_size
    dist.all_gather_object(every_rank, work)
    middle = pipeline.busiest_middle_rank(cell.strategy.name, cell.model_spec.n_layers, cell.world_size)
    kept = [cell.world_size - 1, *([] if middle is None else [middle])]
    return pipeline.other_ranks_work(cell.world_size, {rank: every_rank[rank] for rank in kept})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file each node's local rank 0 writes")
    parser.add_argument("--collectives-only", action="store_true", help="no compute rates, no engines' steps")
    parser.add_argument("--engines", default="", help="comma-separated strategies whose steps to time")
    args = parser.parse_args()
    env = init_from_torchrun()
    # One rank has no peer to time a collective with, but its compute rates and the
    # reference's step still price every cell of a one-GPU run (all of them world size 1).
    no_sweep = ONE_RANK_NO_SWEEP if env.world_size < 2 else None
    rows = [] if no_sweep else bandwidth.sweep(env, bandwidth.message_sizes(env.device.type))
    rates = None
    if not args.collectives_only:
        # As the worker does before each cell (runner/worker.release_memory): what the imports
        # left goes to gc's permanent generation, so no collection of it falls in a timing.
        gc.collect()
        gc.freeze()
        rates = compute_rate.measure(env)
        rates["engines"] = engine_steps(env, [name for name in args.engines.split(",") if name])
    if int(os.environ["LOCAL_RANK"]) == 0:
        args.out.write_text(json.dumps({
            "world_size": env.world_size,
            "backend": dist.get_backend(),
            "device_type": env.device.type,
            "warmup_iters": bandwidth.WARMUP_ITERS,
            "iters": bandwidth.ITERS,
            "repeats": bandwidth.REPEATS,
            "nnodes": env.nnodes,
            "rows": rows,
            **({"no_sweep": no_sweep} if no_sweep else {}),
            **({"compute_rates": rates} if rates is not None else {}),
        }))
    dist.destroy_process_group()
    # As the worker does (runner/worker.py): a library's destructor can abort at interpreter
    # exit ("terminate called without an active exception", seen once in a fresh clone after
    # the calibration built its transformers model), failing a launch whose result is written.
    os._exit(0)


if __name__ == "__main__":
    main()
