"""Run a batch of cells of one world size under torchrun and report each as it ends.

Also the run's calibration, its bandwidth sweep among it (``run_bandwidth_sweep``): one short
torchrun of harness.calibration before the cells.

One torchrun serves many cells (a launch costs ~5 s on the reference CPU host before its first
cell, a tiny cell ~1 s). If the workers die or stop making progress, the cell that was running
is recorded as ``failed`` / ``timeout`` with the tail of the log, torchrun and every worker it
started are killed, and the cells not yet run are relaunched. A launch that spans several nodes is not
started, or is ended while it waits, once a follower node has refused the run
(``LaunchOptions.follower_refusal``, runner/nodes.py): its cells are recorded ``failed`` with
the follower's reason.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from harness.config import CellSpec, RunOptions
from harness.runner import timeouts
from harness.runner.node_spec import SINGLE_NODE, NodeSpec

LOG_TAIL_LINES = 30
POLL_S = 0.2


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    # The run's options: the cell timeout (seconds without an event from the workers, a cell
    # starting or ending, before the launch is declared hung; launch start-up counts against
    # the first cell; None: each cell's own limit, scaled to it, runner/timeouts.py), and what
    # every rank reads (the memory cap: a rank whose memory exceeds it records `oom`, worker.py).
    run: RunOptions = field(default_factory=RunOptions)
    # Where this launcher stands in a multi-node job (runner/node_spec.py); one node by default.
    nodes: NodeSpec = SINGLE_NODE
    # Where the cells run: the scaled timeouts read the device's FLOP rate.
    device_type: str = "cpu"
    device_name: str | None = None
    # --memory-snapshot: the run's folder for every cell's memory timeline (worker.py).
    memory_snapshot_dir: Path | None = None
    # --profile: where the workers write each cell's profiler traces (measure/profiling.py).
    profile_dir: Path | None = None
    # Node 0 of several: why a follower refused the run, once one has (PlanServer.refusal).
    follower_refusal: Callable[[], str | None] = lambda: None

    def timeout(self, cell: CellSpec) -> timeouts.CellTimeout:
        return timeouts.for_cell(cell, self.run.cell_timeout_s, self.device_type, self.device_name)


def nodes_of(world_size: int, nodes: NodeSpec) -> int:
    """How many nodes a launch of ``world_size`` ranks spans: the single-process references
    run on one node (node 0), everything else on all of them."""
    return nodes.nnodes if world_size > 1 else 1


def torchrun_args(world_size: int, nodes: NodeSpec = SINGLE_NODE, rdzv_id: str = "shardbench",
                  timeout_s: float = timeouts.FALLBACK_S) -> list[str]:
    if nodes_of(world_size, nodes) == 1:
        # --standalone: a local rendezvous on a free port, so concurrent runs never collide.
        return ["--standalone", "--nproc-per-node", str(world_size)]
    if world_size % nodes.nnodes:
        raise ValueError(f"world size {world_size} does not split over {nodes.nnodes} nodes")
    # c10d rendezvous: node 0's torchrun hosts the store at the endpoint (is_host, rather than
    # guessing from host names, which fails when every node is 127.0.0.1); the others wait for
    # it up to the cell timeout, since node 0 traces and runs the references first.
    wait = max(60, int(timeout_s))
    return [
        # No --node-rank: c10d assigns the node ranks (torchrun ignores it there); which node
        # holds global rank 0 does not matter, since every node's local rank 0 writes its
        # node's stream (worker.py).
        "--nnodes", str(nodes.nnodes), "--nproc-per-node", str(world_size // nodes.nnodes),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes.master_addr}:{nodes.master_port}",
        "--rdzv-id", rdzv_id,
        "--rdzv-conf", f"is_host={str(nodes.is_leader).lower()},read_timeout={wait},join_timeout={wait}",
        "--max-restarts", "0",
    ]


@dataclass(frozen=True, kw_only=True)
class CellOutcome:
    cell: CellSpec
    status: str  # ok | oom | failed | timeout (per the worker or the launcher)
    reason: str
    per_rank: list[dict]
    wall_s: float
    # An oom's highest peak over the ranks that reported one (worker.py: peak_reached_bytes).
    peak_reached_bytes: int | None = None


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# torchrun's error summary names the rank that failed first ("Root Cause"); the others it
# stopped itself (SIGTERM) and are listed as failures too.
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*exitcode\s*:\s*(-?\d+)", re.S)


def _crash_reason(status: int | None, workdir: Path, log_file: Path) -> str:
    """Which rank died, how, and the last lines it wrote (its own stderr, kept per rank by
    torchrun's --log-dir); the launch log's tail where torchrun did not say."""
    found = _ROOT_CAUSE.search(_tail(log_file, lines=4 * LOG_TAIL_LINES))
    if not found:
        return f"workers exited with status {status}; log tail:\n{_tail(log_file)}"
    rank, local_rank, code = found.group(1), found.group(2), int(found.group(3))
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    own = next(iter(sorted((workdir / "ranks").glob(f"*/attempt_*/{local_rank}/stderr.log"))), None)
    lines = _tail(own) if own else ""
    return (f"rank {rank} {how}, the first rank to fail (torchrun then stopped the others); its last lines:\n"
            f"{lines or '(none)'}")


class _Launch:
    """A torchrun and every process it starts, remembered as they appear so that all of
    them can be ended: a hung rank outlives a killed torchrun otherwise."""

    def __init__(self, cmd: list[str], log_file: Path, env: dict[str, str]):
        with log_file.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._root = psutil.Process(self.proc.pid)
        self._known = {self._root}

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            self._known.update(self._root.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
        return True

    def kill(self) -> None:
        self.alive()  # pick up the latest children first
        for process in self._known:
            try:
                process.kill()  # psutil checks the start time: a reused pid is never hit
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()
        psutil.wait_procs(list(self._known), timeout=10)


def _events(stream, launch: _Launch) -> Iterator[dict | None]:
    """The worker events as they are written; None on each idle poll. Ends once the launch
    has exited and everything it wrote has been read."""
    partial, exited = "", False
    while True:
        partial += stream.readline()
        if partial.endswith("\n"):
            yield json.loads(partial)
            partial = ""
            continue
        if exited:
            return
        exited = not launch.alive()
        yield None
        time.sleep(POLL_S)


def _outcome_from_worker(cell: CellSpec, per_rank: list[dict], wall_s: float) -> CellOutcome:
    bad = [r for r in per_rank if r["status"] != "ok"]
    if not bad:
        return CellOutcome(cell=cell, status="ok", reason="", per_rank=per_rank, wall_s=wall_s)
    first = bad[0]
    reached = [r["peak_reached_bytes"] for r in bad if r.get("peak_reached_bytes") is not None]
    return CellOutcome(cell=cell, status=first["status"], reason=f"rank {first['rank']}: {first['reason']}",
                       per_rank=[], wall_s=wall_s, peak_reached_bytes=max(reached, default=None))


def run_batch(cells: list[CellSpec], options: LaunchOptions, workdir: Path,
              on_outcome: Callable[[CellOutcome], None]) -> None:
    """Run ``cells`` (all of one world size), calling ``on_outcome`` as each one ends.
    Every launch settles at least one cell, so the loop ends. Each launch gets the next
    launch-NNN folder under ``workdir`` not yet taken: a resumed run's launches go beside the
    first session's, whose logs hold the reasons of the cells they failed. The rendezvous id
    counts this call's launches alone, as a follower node's does (its folders are its own)."""
    remaining = list(cells)
    taken = max((int(number) for p in workdir.glob("launch-*") if (number := p.name.removeprefix("launch-")).isdigit()),
                default=0)
    attempt = 0
    while remaining:
        attempt += 1
        remaining = _launch_once(remaining, options, workdir / f"launch-{taken + attempt:03d}", on_outcome,
                                 rdzv_id=f"shardbench-{workdir.name}-{attempt}")


def _settle(cells: list[CellSpec], status: str, reason: str, wall_s: float,
            on_outcome: Callable[[CellOutcome], None]) -> list[CellSpec]:
    """Record every one of ``cells`` with one outcome; none is left to relaunch."""
    for cell in cells:
        on_outcome(CellOutcome(cell=cell, status=status, reason=reason, per_rank=[], wall_s=wall_s))
    return []


def _launch_once(cells: list[CellSpec], options: LaunchOptions, workdir: Path,
                 on_outcome: Callable[[CellOutcome], None], rdzv_id: str = "shardbench") -> list[CellSpec]:
    """One torchrun over ``cells``; returns the cells it did not get to."""
    world_size = cells[0].world_size
    spans_nodes = nodes_of(world_size, options.nodes) > 1

    def refused() -> str | None:
        return options.follower_refusal() if spans_nodes else None

    if refusal := refused():  # the refusing node will never join: launching would wait for it in vain
        return _settle(cells, "failed", refusal, 0.0, on_outcome)
    workdir.mkdir(parents=True, exist_ok=True)
    cells_file, stream_file, log_file = workdir / "cells.json", workdir / "stream.jsonl", workdir / "log.txt"
    cells_file.write_text(json.dumps([c.to_dict() for c in cells]))
    stream_file.write_text("")  # a fresh stream: never read a previous launch's events
    limits = [options.timeout(cell) for cell in cells]
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        *torchrun_args(world_size, options.nodes, rdzv_id, max(limit.seconds for limit in limits)),
        # Each rank's output also in a file of its own, for the reason of a rank that dies.
        "--log-dir", str(workdir / "ranks"), "--tee", "3",
        "-m", "harness.entry", "harness.runner.worker", "--cells", str(cells_file), "--stream", str(stream_file),
        "--expect-nnodes", str(nodes_of(world_size, options.nodes)), *options.run.to_args("worker"),
        *(["--memory-snapshot-dir", str(options.memory_snapshot_dir)] if options.memory_snapshot_dir else []),
        *(["--profile-dir", str(options.profile_dir)] if options.profile_dir else []),
    ]
    # One OpenMP thread per rank unless the user chose otherwise: torchrun does this only
    # for several ranks, which would give the one-process reference more cores than each
    # rank of the cells it is compared with (and spin-waiting threads on a busy host).
    env = {"OMP_NUM_THREADS": "1", **os.environ}

    # The worker runs the cells in order, so the n-th "done" is cells[n] (a batch may hold
    # the same cell twice: the isolation test does).
    n_done = 0
    any_event = restart = timed_out = False
    started = last_event = time.monotonic()
    launch = _Launch(cmd, log_file, env)
    try:
        with stream_file.open() as stream:
            for event in _events(stream, launch):
                now = time.monotonic()
                if event is None:
                    # The running cell's limit (between cells: the next one's).
                    if now - last_event > limits[min(n_done, len(cells) - 1)].seconds:
                        timed_out = True
                        break
                    if refusal := refused():
                        break
                    continue
                any_event, last_event = True, now
                if event["event"] in ("start", "done") and event["cell_id"] != cells[n_done].cell_id:
                    raise RuntimeError(f"worker reported {event['cell_id']}, expected {cells[n_done].cell_id}")
                if event["event"] == "start":
                    started = now
                elif event["event"] == "done":
                    on_outcome(_outcome_from_worker(cells[n_done], event["per_rank"], now - started))
                    n_done += 1
                    if n_done == len(cells):
                        # Every result is in: the workers only have the process group to
                        # tear down and torchrun its agent (a second or more a launch);
                        # the kill below ends them rather than waiting for that.
                        break
                elif event["event"] == "restart":
                    restart = True
    finally:
        launch.kill()  # whatever happened, no process of this launch outlives it

    left = cells[n_done:]
    wall = time.monotonic() - started
    if refusal:
        return _settle(left, "failed", refusal, wall, on_outcome)
    if timed_out:
        limit = limits[min(n_done, len(cells) - 1)]
        reason = f"no result after {limit.seconds:.0f} s (the limit: {limit.why}); log tail:\n{_tail(log_file)}"
        if not any_event:
            # The launch never started a cell (rendezvous or start-up hang): waiting the
            # full timeout once per remaining cell would only repeat that.
            return _settle(left, "timeout", reason, wall, on_outcome)
        if not left:
            return []  # every cell reported; the workers hung on the way out
        # The running cell (or, between cells, the next one) is the one that hung.
        on_outcome(CellOutcome(cell=left[0], status="timeout", reason=reason, per_rank=[], wall_s=wall))
        return left[1:]
    if left and not restart:
        # The workers died: blame the cell that was running (the first not done), record
        # it, and hand the rest back for a fresh launch.
        on_outcome(CellOutcome(cell=left[0], status="failed",
                               reason=_crash_reason(launch.proc.returncode, workdir, log_file),
                               per_rank=[], wall_s=wall))
        return left[1:]
    return left


# How long a bandwidth sweep may take (its launch, imports and calibration included).
BANDWIDTH_TIMEOUT_S = 300.0


def run_bandwidth_sweep(world_size: int, workdir: Path, timeout_s: float, nodes: NodeSpec = SINGLE_NODE,
                        rdzv_id: str = "shardbench-bandwidth", engines: tuple[str, ...] = ()) -> dict:
    """The calibration launch (harness/calibration.py) over ``world_size`` ranks: this node's
    bandwidth sweep with the compute rates and the steps of ``engines`` (strategies), or,
    given ``nodes`` of several, this node's share of a sweep across them, which every node
    launches alike (``rdzv_id``; collectives only). Its
    JSON (one rank: its compute rates, and ``no_sweep``: it has nothing to communicate with), or
    {"error": why} when it could not run (a launch that failed or outlived ``timeout_s``, with
    its log's tail). A sweep that fails costs the run its bandwidth table, never its cells."""
    workdir.mkdir(parents=True, exist_ok=True)
    out, log_file = workdir / "bandwidth.json", workdir / "log.txt"
    across = nodes_of(world_size, nodes) > 1
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(world_size, nodes, rdzv_id, timeout_s),
           "--log-dir", str(workdir / "ranks"), "--tee", "3",  # a failing rank's own lines, as a cell's
           "-m", "harness.entry", "harness.calibration", "--out", str(out),
           *(["--collectives-only"] if across else ["--engines", ",".join(engines)])]
    launch = _Launch(cmd, log_file, {"OMP_NUM_THREADS": "1", **os.environ})
    try:
        launch.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the bandwidth sweep took more than {timeout_s:.0f} s; log tail:\n{_tail(log_file)}"}
    finally:
        launch.kill()
    if launch.proc.returncode != 0 or not out.exists():
        return {"error": f"the bandwidth sweep failed: {_crash_reason(launch.proc.returncode, workdir, log_file)}"}
    return json.loads(out.read_text())
