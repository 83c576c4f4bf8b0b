"""Several nodes: where this launcher stands in the job (a NodeSpec, runner/node_spec.py), read
from the command line or from SLURM, how node 0 tells the others what to run, and what a
launcher on a node other than node 0 does.

One ``python -m harness run`` per node. The cells whose world size spans the nodes go through
torchrun's c10d rendezvous at ``master_addr:port`` (node 0's torchrun hosts the store); the
single-process references run on node 0 only. Node 0 is the run: it selects, traces, runs the
references, judges equivalence and writes results/ and reports/. A node of rank R > 0 is a
follower: it runs its ranks of the launches node 0 publishes, prints a line per cell, writes
its launch logs under ``<out>/node-launches/`` (never under results/), and exits 0 when every
cell it took part in ended ok (1 otherwise).

The plan: node 0 decides which launches span the nodes (its selection, less what a resumed
run already recorded, less what is unsupported on its device) and serves that list, with its
harness code hash, from a TCPStore on ``master_port + 1`` for as long as it runs. A follower
reads the plan instead of selecting for itself, so a resumed run (whose records only node 0
holds) and a node started with other options run exactly node 0's launches; a follower whose
harness code differs from node 0's refuses to start, and says why in the same store: node 0
then records its launches that span the nodes as ``failed`` with that reason instead of
waiting for the node at each rendezvous until the cell timeout (a follower that never starts
cannot say so: those launches end as ``timeout``).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.config import CellSpec, RunOptions
from harness.runner.node_spec import DEFAULT_MASTER_PORT, NodeSpec

PLAN_KEY = "shardbench/plan"
# The first follower to refuse node 0's plan writes why here (node 0 reads it while it runs).
REFUSAL_KEY = "shardbench/refused"
# How long a follower waits for node 0's plan unless --cell-timeout says more: node 0 may be
# started later by hand, or still be setting up (environment record, bandwidth sweep).
PLAN_WAIT_S = 1800.0


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``scontrol show hostnames`` where it exists, else
    a parser for the compressed forms (``node[01-04,07]``, ``a1,b2``, ``rack1-n[3-4]``)."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    head = re.match(r"[^,\[]*(\[[^\]]*\])?", nodelist.strip())
    assert head is not None  # every part of the pattern is optional: it matches any string
    first = head.group(0)
    bracket = re.fullmatch(r"([^\[]*)\[([^\]]*)\]", first)
    if bracket is None:
        return first
    prefix, ranges = bracket.groups()
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(value: str | None, name: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: not an integer") from None


def resolve(*, nnodes: int | None, node_rank: int | None, master_addr: str | None, master_port: int | None,
            environ: Mapping[str, str] = os.environ) -> NodeSpec:
    """The options given, else SLURM's variables (inside an allocation with one launcher per
    node: ``srun --ntasks-per-node=1``), else a single node. Read from SLURM: SLURM_NNODES
    (nodes), SLURM_NODEID (node rank), the first host of SLURM_JOB_NODELIST (master address),
    and MASTER_PORT where set (else 29500). SLURM_NTASKS_PER_NODE must be 1: each launcher
    starts every rank of its node."""
    slurm_nnodes = _int(environ.get("SLURM_NNODES"), "SLURM_NNODES")
    if nnodes is None and slurm_nnodes is not None and slurm_nnodes > 1:
        tasks = environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]  # e.g. "1(x2)"
        if tasks != "1":
            raise ValueError(f"SLURM_NTASKS_PER_NODE={tasks}: start one launcher per node"
                             " (srun --ntasks-per-node=1); it starts every rank of its node")
        nnodes = slurm_nnodes
    if nnodes is not None and nnodes > 1 and slurm_nnodes is not None:
        if node_rank is None:
            node_rank = _int(environ.get("SLURM_NODEID"), "SLURM_NODEID")
        if master_addr is None and environ.get("SLURM_JOB_NODELIST"):
            master_addr = first_host(environ["SLURM_JOB_NODELIST"])
    if master_port is None and nnodes is not None and nnodes > 1:
        master_port = _int(environ.get("MASTER_PORT"), "MASTER_PORT")
    return NodeSpec(nnodes=1 if nnodes is None else nnodes, node_rank=node_rank or 0, master_addr=master_addr,
                    master_port=DEFAULT_MASTER_PORT if master_port is None else master_port)


def _check_resolves(address: str) -> None:
    """Node 0's address must name a host: a typo would leave every other node waiting for a
    plan that never comes, until its timeout."""
    try:
        socket.getaddrinfo(address, None)
    except (socket.gaierror, UnicodeError) as error:
        raise ValueError(f"--master-addr {address!r}: not a host name or address this node can resolve"
                         f" ({error})") from None


def of_options(options: RunOptions, environ: Mapping[str, str] = os.environ) -> NodeSpec:
    """``resolve`` for a run's node options (--nnodes, --node-rank, --master-addr, --master-port),
    with node 0's address checked to resolve on this node."""
    spec = resolve(nnodes=options.nnodes, node_rank=options.node_rank, master_addr=options.master_addr,
                   master_port=options.master_port, environ=environ)
    if spec.multi and spec.master_addr is not None:
        _check_resolves(spec.master_addr)
    return spec


def slurm_ranks_per_node(environ: Mapping[str, str] = os.environ) -> int | None:
    """SLURM_GPUS_ON_NODE: the default ranks per node on a GPU node inside an allocation."""
    value = environ.get("SLURM_GPUS_ON_NODE")
    return _int(value, "SLURM_GPUS_ON_NODE") if value else None


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What node 0 tells the others: its run, per trial the cells of the launches that span
    the nodes in the order it runs them, and the launch options its workers take (a follower's
    own would make the ranks of one launch disagree: a memory cap is a collective check)."""

    run_id: str | None  # None: node 0 selected nothing to run
    rounds: list[list]
    cell_timeout_s: float | None
    mem_cap_bytes: int | None
    # The ranks of the bandwidth sweep across the nodes every node joins before the cells;
    # None: no sweep (--no-bandwidth, a resumed run).
    sweep_world_size: int | None = None


def _plan_host(nodes: NodeSpec) -> str:
    """Node 0's address, where the plan is served: NodeSpec requires it of a job of several nodes."""
    if nodes.master_addr is None:
        raise ValueError("the run plan is served on node 0's address: give --master-addr")
    return nodes.master_addr


class PlanServer:
    """Node 0's end: binds the plan port when made, so a taken port is refused before anything
    runs, and serves the plan once ``publish`` is called, until ``close``."""

    def __init__(self, nodes: NodeSpec):
        from torch.distributed import DistError, TCPStore

        try:
            self._store: TCPStore | None = TCPStore(_plan_host(nodes), nodes.plan_port, is_master=True,
                                                    wait_for_workers=False)
        except DistError as error:
            raise ValueError(f"node 0 cannot serve the run plan on port {nodes.plan_port} (--master-port + 1):"
                             f" {str(error).splitlines()[0]}") from None

    def publish(self, plan: Plan, code_hash: str) -> None:
        if self._store is None:
            raise RuntimeError("the plan server is closed")
        self._store.set(PLAN_KEY, json.dumps({
            "code_hash": code_hash, "run_id": plan.run_id, "cell_timeout_s": plan.cell_timeout_s,
            "mem_cap_bytes": plan.mem_cap_bytes, "sweep_world_size": plan.sweep_world_size,
            "rounds": [[c.to_dict() for c in cells] for cells in plan.rounds]}))

    def refusal(self) -> str | None:
        """Why a follower refused the plan (the first to), or None while none has."""
        if self._store is None or not self._store.check([REFUSAL_KEY]):
            return None
        return self._store.get(REFUSAL_KEY).decode()

    def close(self) -> None:
        self._store = None  # the server stops with its last reference


def fetch_plan(nodes: NodeSpec, code_hash: str, wait_s: float) -> Plan:
    """A follower: node 0's plan, waiting up to ``wait_s`` for node 0 to serve it.
    ValueError (one line) when node 0 never does or runs other harness code."""
    from torch.distributed import DistError, TCPStore

    try:
        store = TCPStore(_plan_host(nodes), nodes.plan_port, is_master=False,
                         timeout=datetime.timedelta(seconds=wait_s))
        served = json.loads(store.get(PLAN_KEY))
    except DistError as error:
        raise ValueError(f"no run plan from node 0 at {nodes.master_addr}:{nodes.plan_port} within {wait_s:.0f} s"
                         f" (is node 0 started with the same --master-addr/--master-port?):"
                         f" {str(error).splitlines()[0]}") from None
    if served["code_hash"] != code_hash:
        # compare_set: the first refusal stays, the one node 0 reports.
        store.compare_set(REFUSAL_KEY, "", f"node {nodes.node_rank} refused the run: it runs harness code"
                          f" {code_hash}, node 0 {served['code_hash']} (check out the same shardbench commit on"
                          " every node)")
        raise ValueError(f"node 0 runs harness code {served['code_hash']}, this node {code_hash}: check out the"
                         " same shardbench commit on every node")
    return Plan(run_id=served["run_id"], cell_timeout_s=served["cell_timeout_s"],
                mem_cap_bytes=served["mem_cap_bytes"], sweep_world_size=served["sweep_world_size"],
                rounds=[[CellSpec.from_dict(d) for d in cells] for cells in served["rounds"]])


def sweep_rdzv_id(run_id: str | None) -> str:
    """The rendezvous of a run's bandwidth sweep across the nodes, the same on every node."""
    return f"shardbench-bandwidth-{run_id}"


def run_follower(plan: Plan, options, launch_dir: Path, progress: Callable[[str], None] = print) -> int:
    """A node of rank > 0: its ranks of node 0's launches (``plan``, from ``fetch_plan``),
    launched as node 0 launches them (one torchrun per world size and trial, named alike: the
    name is part of the rendezvous id). Nothing under results/; returns 0 when every cell
    ended ok, else 1."""
    # Imported here, not at the top: the CLI imports this module to check its arguments
    # (resolve), and the matrix brings in the strategies and transformers (seconds).
    from harness.runner.launcher import BANDWIDTH_TIMEOUT_S, run_bandwidth_sweep
    from harness.runner.matrix import human_duration, launch_round

    rounds = plan.rounds
    total = sum(map(len, rounds))
    progress(f"shardbench: node {options.nodes.node_rank} of {options.nodes.nnodes}: node 0's plan for run"
             f" {plan.run_id} has {total} cell runs that span the nodes; node 0 writes the results; launch logs"
             f" in {launch_dir}")
    statuses: list[str] = []
    started = time.monotonic()
    if plan.sweep_world_size is not None:
        swept = run_bandwidth_sweep(plan.sweep_world_size, launch_dir / "bandwidth", BANDWIDTH_TIMEOUT_S,
                                    options.nodes, sweep_rdzv_id(plan.run_id))
        progress(f"shardbench: node {options.nodes.node_rank}: bandwidth sweep across the nodes: "
                 + (swept["error"].splitlines()[0] if "error" in swept else "done (node 0 records it)"))

    def on_outcome(outcome) -> None:
        statuses.append(outcome.status)
        first = outcome.reason.splitlines()[0][:100] if outcome.reason else ""
        progress(f"[{len(statuses):>3}/{total}] {outcome.status:<11} {outcome.cell.cell_id:<58} {first}")

    for trial, cells in enumerate(rounds):
        launch_round(cells, trial, options, launch_dir, on_outcome)
    bad = sum(s not in ("ok", "oom") for s in statuses)
    progress(f"shardbench: node {options.nodes.node_rank}: {len(statuses) - bad} ok, {bad} not ok"
             f" in {human_duration(time.monotonic() - started)}")
    return 0 if bad == 0 else 1
