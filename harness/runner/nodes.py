"""Several nodes: where this launcher stands in the job, read from the command line or from
SLURM, and what a launcher on a node other than node 0 does.

One ``python -m harness run`` per node. Every node runs the same selection; the cells whose
world size spans the nodes go through torchrun's c10d rendezvous at ``master_addr:port``
(node 0's torchrun hosts the store); the single-process references run on node 0 only.
Node 0 is the run: it traces, runs the references, judges equivalence and writes results/
and reports/. A node of rank R > 0 is a follower: it runs its ranks of the same launches,
prints a line per cell, writes its launch logs under ``<out>/node-launches/`` (never under
results/), and exits 0 when every cell it took part in ended ok (1 otherwise).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """This launcher's place in the job. ``nnodes == 1`` is today's single node: torchrun
    --standalone, a private rendezvous on a free port."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes {self.nnodes}: must be 1 or more")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank}: must be in [0, {self.nnodes}) for --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError(f"--nnodes {self.nnodes}: --master-addr is required (node 0's address, the same on"
                             " every node)")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port {self.master_port}: must be in 1-65535")

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    def to_dict(self) -> dict:
        return {"nnodes": self.nnodes, "node_rank": self.node_rank, "master_addr": self.master_addr,
                "master_port": self.master_port}


SINGLE_NODE = NodeSpec()


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
    first = re.match(r"[^,\[]*(\[[^\]]*\])?", nodelist.strip()).group(0)
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


def slurm_ranks_per_node(environ: Mapping[str, str] = os.environ) -> int | None:
    """SLURM_GPUS_ON_NODE: the default ranks per node on a GPU node inside an allocation."""
    value = environ.get("SLURM_GPUS_ON_NODE")
    return _int(value, "SLURM_GPUS_ON_NODE") if value else None


def run_follower(cells: list, options, launch_dir: Path, device_type: str,
                 progress: Callable[[str], None] = print, repeat: int = 1) -> int:
    """A node of rank > 0: its ranks of every launch that spans the nodes, in the order node 0
    runs them (MatrixRun's: ``repeat`` rounds of references first, then by world size,
    unsupported cells left out). Nothing under results/; returns 0 when every cell ended ok,
    else 1."""
    from harness import strategies
    from harness.runner.launcher import run_batch
    from harness.runner.matrix import human_duration, launch_dir_name, with_references

    runnable = [c for c in with_references(cells)
                if c.world_size > 1 and not strategies.unsupported_reason(c, device_type)]
    total = len(runnable) * repeat
    progress(f"shardbench: node {options.nodes.node_rank} of {options.nodes.nnodes}: {len(runnable)} cells span"
             f" the nodes{f', {repeat} trials each' if repeat > 1 else ''}; node 0 writes the results;"
             f" launch logs in {launch_dir}")
    statuses: list[str] = []
    started = time.monotonic()

    def on_outcome(outcome) -> None:
        statuses.append(outcome.status)
        first = outcome.reason.splitlines()[0][:100] if outcome.reason else ""
        progress(f"[{len(statuses):>3}/{total}] {outcome.status:<11} {outcome.cell.cell_id:<58} {first}")

    for trial in range(repeat):
        for world_size, group in groupby(runnable, key=lambda c: c.world_size):
            run_batch(list(group), options, launch_dir / launch_dir_name(world_size, trial), on_outcome)
    bad = sum(s not in ("ok", "oom") for s in statuses)
    progress(f"shardbench: node {options.nodes.node_rank}: {len(statuses) - bad} ok, {bad} not ok"
             f" in {human_duration(time.monotonic() - started)}")
    return 0 if bad == 0 else 1
