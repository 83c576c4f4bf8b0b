"""``python -m harness plan``: the predicted peak memory per GPU of every strategy and option
combination, and the one to rent the GPUs for (harness/predict/plan.py)."""

from __future__ import annotations

import argparse

from harness.cli_common import UsageError


def cmd_plan(args: argparse.Namespace, extra: list[str]) -> int:
    """Predicted peak memory per GPU of every strategy and option combination."""
    from harness.config import parse_bytes
    from harness.features.precision import DTYPES
    from harness.models import sources
    from harness.predict import plan

    if args.precision not in DTYPES:
        raise UsageError(f"--precision {args.precision}: choose one of {', '.join(DTYPES)}")
    try:
        req = plan.PlanRequest(model=sources.resolve(args.model, "--model"), gpus=args.gpus, nodes=args.nodes,
                               seq=args.seq,
                               micro_batch=args.micro_batch, gpu_mem_bytes=parse_bytes(args.gpu_mem),
                               precision=args.precision, optimizer=args.optimizer)
    except ValueError as error:
        raise UsageError(str(error)) from None
    trace = None
    if args.traced:
        from harness.predict import traced as tracer

        trace = tracer.trace_cells
    try:
        result = plan.plan(req, trace=trace, named=args.config)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.format == "json":
        print(plan.as_json(result))
    else:
        print(plan.as_table(result, markdown=args.format == "markdown"))
    return 0
