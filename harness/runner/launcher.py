"""Run a batch of cells of one world size under torchrun and report each as it ends.

One torchrun serves many cells (a launch costs ~5.5 s on the reference CPU host, a tiny cell
~1 s). If the workers die or stop making progress, the cell that was running is recorded as
``failed`` / ``timeout`` with the tail of the log, torchrun and every worker it started are
killed, and the cells not yet run are relaunched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from harness.config import CellSpec

LOG_TAIL_LINES = 30
POLL_S = 0.2


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    cell_timeout_s: float = 600.0

    @staticmethod
    def torchrun_args(world_size: int) -> list[str]:
        # --standalone: a local rendezvous on a free port, so concurrent runs never collide.
        return ["--standalone", "--nproc-per-node", str(world_size)]


@dataclass(frozen=True, kw_only=True)
class CellOutcome:
    cell: CellSpec
    status: str  # ok | oom | failed | timeout (per the worker or the launcher)
    reason: str
    per_rank: list[dict]
    wall_s: float


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _kill_launch(proc: subprocess.Popen) -> None:
    """End torchrun and every worker it started. The workers run in sessions of their own,
    so killing torchrun's process group alone would orphan a hung rank."""
    try:
        parent = psutil.Process(proc.pid)
        processes = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        processes = []
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(processes, timeout=10)


def _outcome_from_worker(cell: CellSpec, per_rank: list[dict], wall_s: float) -> CellOutcome:
    bad = [r for r in per_rank if r["status"] != "ok"]
    if not bad:
        return CellOutcome(cell=cell, status="ok", reason="", per_rank=per_rank, wall_s=wall_s)
    first = bad[0]
    return CellOutcome(cell=cell, status=first["status"], reason=f"rank {first['rank']}: {first['reason']}",
                       per_rank=[], wall_s=wall_s)


def run_batch(cells: list[CellSpec], options: LaunchOptions, workdir: Path,
              on_outcome: Callable[[CellOutcome], None]) -> None:
    """Run ``cells`` (all of one world size), calling ``on_outcome`` as each one ends."""
    remaining = list(cells)
    attempt = 0
    while remaining:
        attempt += 1
        remaining = _launch_once(remaining, options, workdir / f"launch-{attempt:03d}", on_outcome)


def _launch_once(cells: list[CellSpec], options: LaunchOptions, workdir: Path,
                 on_outcome: Callable[[CellOutcome], None]) -> list[CellSpec]:
    """One torchrun over ``cells``; returns the cells it did not get to."""
    workdir.mkdir(parents=True, exist_ok=True)
    cells_file, stream_file, log_file = workdir / "cells.json", workdir / "stream.jsonl", workdir / "log.txt"
    cells_file.write_text(json.dumps([c.to_dict() for c in cells]))
    stream_file.touch()
    by_id = {c.cell_id: c for c in cells}
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        *options.torchrun_args(cells[0].world_size),
        "-m", "harness.runner.worker", "--cells", str(cells_file), "--stream", str(stream_file),
    ]
    # One OpenMP thread per rank unless the user chose otherwise: torchrun does this only
    # for several ranks, which would give the one-process reference more cores than each
    # rank of the cells it is compared with (and spin-waiting threads on a busy host).
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    with log_file.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    done: set[str] = set()
    running: str | None = None
    started_at = time.monotonic()
    partial, exited, timed_out = "", False, False
    with stream_file.open() as stream:
        while True:
            partial += stream.readline()
            if partial.endswith("\n"):
                event = json.loads(partial)
                partial = ""
                if event["event"] == "start":
                    running, started_at = event["cell_id"], time.monotonic()
                else:
                    done.add(event["cell_id"])
                    on_outcome(_outcome_from_worker(by_id[event["cell_id"]], event["per_rank"],
                                                    time.monotonic() - started_at))
                    running, started_at = None, time.monotonic()
                continue
            if exited:
                break
            exited = proc.poll() is not None  # after exit, one more pass drains the stream
            if time.monotonic() - started_at > options.cell_timeout_s:
                # No event for too long: a hung collective, or a launch that never started.
                _kill_launch(proc)
                culprit = running or next(c.cell_id for c in cells if c.cell_id not in done)
                on_outcome(CellOutcome(cell=by_id[culprit], status="timeout",
                                       reason=f"no result after {options.cell_timeout_s:.0f} s; "
                                              f"log tail:\n{_tail(log_file)}",
                                       per_rank=[], wall_s=time.monotonic() - started_at))
                done.add(culprit)
                running, timed_out = None, True
                break
            time.sleep(POLL_S)
    _kill_launch(proc)  # stragglers of a finished launch must not outlive it
    left = [c for c in cells if c.cell_id not in done]
    if left and not timed_out:
        # The workers died: blame the running cell (or, before any cell started, the first),
        # record it, and hand the rest back for a fresh launch. Every launch thus settles at
        # least one cell, so a batch always ends.
        culprit = by_id[running] if running is not None else left[0]
        on_outcome(CellOutcome(cell=culprit, status="failed",
                               reason=f"workers exited with status {proc.returncode}; log tail:\n{_tail(log_file)}",
                               per_rank=[], wall_s=time.monotonic() - started_at))
        left.remove(culprit)
    return left
