"""``python -m harness run``: a run of the selected cells, as pytest's session of the suites on
node 0, as a follower of node 0's plan on any other node (runner/nodes.py), or the rest of a
recorded run (``--resume``). Every option is checked before anything is launched."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.cli_common import EXIT_USAGE, REPO_ROOT, UsageError, recorded_run, run_options
from harness.cli_selection import check_selection, pytest_args, use_device
from harness.config import RunOptions, gib_of
from harness.runner import nodes


def cmd_run(args: argparse.Namespace, extra: list[str]) -> int:
    from harness.runner import resume

    options = run_options(args)
    options, node = _resolve_nodes(options)
    if options.resume is not None and node.is_leader:  # the other nodes follow node 0's plan
        options = _resume_selection(options, RunOptions.given(args, "cli"), node)
    if node.is_leader:  # a follower runs node 0's selection, not its own
        options = check_selection(options, node.nnodes)
    else:
        use_device(options)
    _check_mem_cap_fits(options)
    made_out = options.out is not None and not options.out.exists()
    if options.out is not None:  # made last: no refused run leaves a folder behind
        _check_out_writable(options.out)
        options.out.mkdir(parents=True, exist_ok=True)
        options = dataclasses.replace(options, out=options.out.resolve())
    if not node.is_leader:
        return _run_follower(options, node)
    code = int(pytest.main([*pytest_args(options), "-rfEs", *extra]))
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        # A -k matching no cell's test id, or a -m naming only tests this suite does not have
        # (-m claims beside --suite smoke; -m was held against the cells before): refused, so
        # the --out folder made for it goes again (it is empty: nothing ran).
        if made_out and options.out is not None and not any(options.out.iterdir()):
            options.out.rmdir()
        given = [f"{flag} {expr!r}" for flag, expr in (("-m", options.marker_expression),
                                                      ("-k", options.keyword_expression)) if expr]
        print(f"shardbench: {' with '.join(given) or 'the selection'} selects none of suite {options.suite}'s tests:"
              " `python -m harness list` shows their cells' ids and markers", file=sys.stderr)
        return EXIT_USAGE
    # Ended by SIGTERM / SIGINT: the shell's 128 + N, never 0 (the finished cells are kept).
    return 128 + resume.Interrupted.signum if resume.Interrupted.signum else code


def _check_out_writable(out: Path) -> None:
    """--out, or the folder it would be made in, must take files: refused before anything runs."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: {existing} is not writable (read-only, or not yours): choose another folder")


def _resolve_nodes(options: RunOptions) -> tuple[RunOptions, nodes.NodeSpec]:
    """--nnodes/--node-rank/--master-addr/--master-port, else SLURM's variables (README
    "Several nodes"), checked before anything launches: this node's place in the job, and the
    options holding it (what pytest is handed: it reads no SLURM variables)."""
    from harness.distributed import device_type

    try:
        node = nodes.of_options(options)
        options = dataclasses.replace(options, **node.to_dict())
        # A resumed run keeps its own ranks per node (run.json), whatever the allocation offers.
        if (node.multi and options.gpus is None and options.resume is None
                and (options.device or device_type()) == "cuda"):  # a GPU node in a SLURM allocation
            options = dataclasses.replace(options, gpus=nodes.slurm_ranks_per_node())
    except ValueError as error:
        raise UsageError(str(error)) from None
    return options, node


def _resume_selection(options: RunOptions, given: dict[str, Any], node: nodes.NodeSpec) -> RunOptions:
    """--resume: the run's own selection (suite, -m, -k, world size, device, --gpu-mem) from its run.json;
    an option ``given`` that differs from it is refused, as is a run that cannot be found."""
    from harness.distributed import DEVICES, job_world_size
    from harness.runner import resume

    if options.resume is None:
        raise ValueError("--resume: name the run to resume (a run id, 'latest' or a run folder)")
    run_dir = recorded_run(options.out, options.resume)
    try:
        original = resume.original_selection(run_dir)
        # The fields that run.json keeps under their own names.
        kept = ("suite", "marker_expression", "keyword_expression", "device", "repeat", "gpu_mem")
        asked: dict[str, object] = {key: given[key] for key in kept if key in given}
        asked["nnodes"] = node.nnodes
        if "mem_cap_gib" in given:
            asked["mem_cap_bytes"] = options.mem_cap_bytes
        if "gpus" in given:
            asked["world_size"] = job_world_size(options.gpus, node.nnodes)
        resume.check_same_selection(run_dir, original, asked)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return dataclasses.replace(
        options, resume=str(run_dir), suite=original["suite"], marker_expression=original["marker_expression"],
        keyword_expression=original["keyword_expression"], gpus=original["world_size"] // original["nnodes"],
        mem_cap_gib=options.mem_cap_gib if original["mem_cap_bytes"] is None else gib_of(original["mem_cap_bytes"]),
        gpu_mem=original["gpu_mem"],
        device=original["device"] if options.device is None and original["device"] in DEVICES else options.device,
        out=run_dir.parent.parent if options.out is None else options.out)  # reports/ beside the run's results/


def _run_follower(options: RunOptions, node: nodes.NodeSpec) -> int:
    """A node of rank > 0: its ranks of the launches node 0 serves (its selection, or what its
    resumed run still lacks), nothing under results/ (runner/nodes.py)."""
    from harness.distributed import device_type
    from harness.results.provenance import harness_code_hash
    from harness.results.store import new_run_id
    from harness.runner.launcher import LaunchOptions

    wait_s = max(nodes.PLAN_WAIT_S, options.cell_timeout_s or 0)
    print(f"shardbench: node {node.node_rank}: waiting for node 0's plan at {node.master_addr}:"
          f"{node.plan_port} (up to {wait_s:.0f} s)", flush=True)
    try:
        plan = nodes.fetch_plan(node, harness_code_hash(), wait_s)
    except ValueError as error:
        print(f"shardbench: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    launch_dir = (options.out or REPO_ROOT).resolve() / "node-launches" / f"node{node.node_rank}-{new_run_id()}"
    # Node 0's limits, not this node's options: every rank of a launch must agree on them.
    limits = RunOptions(cell_timeout_s=plan.cell_timeout_s, mem_cap_gib=gib_of(plan.mem_cap_bytes))
    launch = LaunchOptions(run=limits, nodes=node, device_type=device_type(), device_name=_device_name())
    return nodes.run_follower(plan, launch, launch_dir)


def _device_name() -> str | None:
    import torch

    from harness.distributed import device_type

    return torch.cuda.get_device_name() if device_type() == "cuda" else None


def _check_mem_cap_fits(options: RunOptions) -> None:
    """--mem-cap-gib on CUDA: no more than the GPU has (RunOptions checks it is positive)."""
    import torch

    from harness.distributed import device_type

    if options.mem_cap_bytes is None or device_type() != "cuda":
        return
    total = torch.cuda.get_device_properties(0).total_memory
    if options.mem_cap_bytes > total:
        raise UsageError(f"--mem-cap-gib {options.mem_cap_gib}: more than the {total / 2**30:.1f} GiB"
                         f" of {torch.cuda.get_device_name(0)}; give at most that")
