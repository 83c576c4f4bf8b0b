"""``python -m harness plan``: the predicted peak memory per GPU of every strategy and option
combination, and the one to rent the GPUs for (harness/predict/plan.py)."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from harness.cli_common import UsageError, measured_rates

if TYPE_CHECKING:
    from harness.predict.plan import PlanRequest
    from harness.predict.rough_time import Rates


def cmd_plan(args: argparse.Namespace, extra: list[str]) -> int:
    """Predicted peak memory per GPU of every strategy and option combination."""
    from harness.config import parse_bandwidth, parse_bytes
    from harness.features.precision import DTYPES
    from harness.models import sources
    from harness.predict import plan
    from harness.predict import traced as tracer

    if args.precision not in DTYPES:
        raise UsageError(f"--precision {args.precision}: choose one of {', '.join(DTYPES)}")
    try:
        host_mem = None if args.host_mem is None else parse_bytes(args.host_mem, "--host-mem")
        network = None if args.inter_node_bw is None else parse_bandwidth(args.inter_node_bw, "--inter-node-bw")
        req = plan.PlanRequest(model=sources.resolve(args.model, "--model"), gpus=args.gpus, nodes=args.nodes,
                               seq=args.seq, micro_batch=args.micro_batch, global_batch=args.global_batch,
                               gpu_mem_bytes=parse_bytes(args.gpu_mem),
                               precision=args.precision, optimizer=args.optimizer, attention=args.attention,
                               host_mem_bytes=host_mem, inter_node_bytes_per_s=network)
    except ValueError as error:
        raise UsageError(str(error)) from None
    rates, measured, work_trace = None, None, None
    if args.gpu is not None:
        rates = _datasheet_rates(args.gpu, args.calibration, req)
    if args.calibration is not None:
        rates, run_dir = measured_rates(args.calibration, req.inter_node_bytes_per_s)
        measured = _measured_steps(run_dir) if run_dir is not None else None
        # Seconds a configuration: say so before the terminal goes quiet.
        print(f"plan: tracing each configuration's first blocks, to price its step at {rates.source}",
              file=sys.stderr, flush=True)
        work_trace = functools.partial(tracer.trace_cells, progress=_progress, work_only=True)
    try:
        # Traced as a GPU runs it: CUDA's attention and optimizer kernels (predict/traced.py, "Kernels").
        memory_trace = functools.partial(tracer.trace_cells, kernels="cuda") if args.traced else None
        result = plan.plan(req, trace=memory_trace, named=args.config, rates=rates,
                           work_trace=work_trace, measured=measured)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.format == "json":
        print(plan.as_json(result))
    else:
        print(plan.as_table(result, markdown=args.format == "markdown"))
    return 0


def _datasheet_rates(gpu: str, calibration: str | None, req: PlanRequest) -> Rates:
    """rough_time's assumptions for the GPU ``gpu`` names (UsageError where it names none of
    the listed GPUs or several, or where a calibration would price the steps instead)."""
    from harness.measure import flops
    from harness.predict import rough_time

    if calibration is not None:
        raise UsageError(f"--gpu with --calibration: {calibration}'s own device prices the steps; give one of them")
    try:
        return rough_time.assumed(flops.known_device(gpu), world_size=req.gpus, nodes=req.nodes,
                                  inter_node_bytes_per_s=req.inter_node_bytes_per_s)
    except ValueError as error:
        raise UsageError(f"--gpu {error}") from None


def _measured_steps(run_dir: Path) -> dict[str, float]:
    """cell_id -> the median step the run measured, for its ok cells."""
    from harness.results import store, trials

    return {r["cell_id"]: r["metrics"]["step_time_s"] for r in trials.aggregate(store.load_records(run_dir))
            if r["status"] == "ok" and r["metrics"].get("step_time_s")}


def _progress(traced: int, total: int) -> None:
    print(f"plan: {traced} of {total} traced", file=sys.stderr, flush=True)
