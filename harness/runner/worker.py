"""What every rank runs: a batch of cells in one process group, one after the other.

Launched by harness.runner.launcher through torchrun. Each cell is trained and measured by
harness/training.py (warm-up, the memory-tracked step, the comm-counted step, the timed
steps); this module is the process around it. Rank 0 writes one JSON line per event to the
stream file (``start`` before a cell, ``done`` after it with every rank's numbers), flushed at
once, so the launcher can report progress and knows which cell was running if the process
dies. After a cell that failed on any rank, the process group may be out of step (a rank left
mid-collective), so the workers write ``restart`` and leave; the launcher runs the remaining
cells in a fresh launch. They leave the same way when a host runs short of memory between
cells (``host_memory_short``).

With ``--memory-snapshot-dir`` each cell's memory-tracked step writes its memory timeline
(and on CUDA the allocator's snapshot) there (harness/training.py says where).

The CUDA caching allocator's settings are set to torch's defaults as the worker starts,
whatever PYTORCH_CUDA_ALLOC_CONF says (setting expandable segments off resets every setting
the call does not name): a cell runs with other settings only when it asks for them
(CellSpec.allocator_settings, harness/training.py).

A memory cap (``--mem-cap-gib``) makes each rank behave as if its
device had that much memory. On CUDA the caching allocator enforces it
(``set_per_process_memory_fraction``): an allocation beyond it raises the real OOM. On the
CPU there is no allocator limit to set, so the cap is checked against the peak the record
reports (the memory-tracked step, after warm-up): when any rank's peak exceeds it, every
rank ends the cell as ``oom`` together. Either way the record keeps the peak reached.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import gc
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from harness import entry, faults
from harness.config import CellSpec, RunOptions, add_run_options
from harness.distributed import DistEnv, init_from_torchrun
from harness.training import MemoryCapExceeded, run_cell

TRACEBACK_LINES = 15
# What a finished cell leaves in its process (freed memory the allocators keep, libraries'
# caches and module-level state) is not all handed back: at real sizes on the CPU 0.3-1.6 GB
# a cell per rank (the real suite's ranks grew from 3.3 to 10.3 GB over 15 cells of one
# launch until the host's OOM killer took one). With less than this share of a host's memory
# available after a cell, the workers leave and the rest run in fresh processes.
LOW_HOST_MEMORY_FRACTION = 0.4


def peak_reached(error: BaseException, env: DistEnv) -> int | None:
    """The memory a rank had reached when ``error`` ended its cell, where that is known."""
    if isinstance(error, MemoryCapExceeded):
        return error.peak_reached_bytes
    if env.is_cuda and isinstance(error, torch.OutOfMemoryError):
        return torch.cuda.max_memory_allocated(env.device)  # reset as the cell began
    return None


def outcome_of(error: BaseException) -> str:
    # CUDA raises OutOfMemoryError; the CPU allocator a RuntimeError that says so.
    if isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error):
        return "oom"
    return "failed"


def release_memory(device: torch.device) -> None:
    """Give back what the finished cell held so the next cell's peak starts from the floor,
    and move every object still alive (imports, the libraries' caches) to gc's permanent
    generation: the collections and the heap walks of the next cell (measure/memory.py) then
    scan only what it makes. On the reference host that is 0.3 s a collection for the ~360k
    objects torch and transformers leave, four to five of them a cell, and a tiny cell's
    whole run was 3 s."""
    gc.collect()
    gc.freeze()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass  # not glibc: RSS stays higher, tensor-byte measurements are unaffected


def host_memory_short(cell: CellSpec, env: DistEnv) -> str:
    """Why the workers should leave before the next cell ("" if no rank's host is short of
    memory): every rank asks its own host, and all of them hear every answer."""
    memory = psutil.virtual_memory()
    short = (memory.available < LOW_HOST_MEMORY_FRACTION * memory.total
             or faults.planned().get(cell.cell_id) == faults.HOST_MEMORY_LOW)
    mine = (f"rank {env.rank}'s host has {memory.available / 2**30:.1f} of {memory.total / 2**30:.1f} GiB"
            f" available after {cell.cell_id}" if short else "")
    everyone: list[str | None] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    return next((answer for answer in everyone if answer), "")


def world_problem(env: DistEnv, cells: list[CellSpec], expect_nnodes: int) -> str:
    """Why this process group cannot run ``cells``, or "" when it can: every rank checks that
    it joined the world the launcher asked for. Two nodes that each started on their own
    (--standalone, or different endpoints) form two worlds of their own ranks: each would run
    every cell with half the ranks and report numbers of a job that never ran."""
    want = cells[0].world_size if cells else env.world_size
    if env.world_size != want or env.nnodes != expect_nnodes:
        return (f"rank {env.rank} joined a world of {env.world_size} rank(s) on {env.nnodes} node(s), but the"
                f" cells need {want} rank(s) on {expect_nnodes} node(s): every node must join the same"
                " rendezvous (the same --nnodes, --master-addr and --master-port on each node; a node"
                " launched --standalone forms a world of its own). Refusing to run.")
    # Every node must run the same cells in the same order, or the ranks would pair
    # collectives of different cells.
    ids = [c.cell_id for c in cells]
    everyone: list[list[str] | None] = [None] * env.world_size
    dist.all_gather_object(everyone, ids)
    differ = [r for r, other in enumerate(everyone) if other != ids]
    if differ:
        return (f"rank {env.rank}: ranks {differ} were given other cells; every node must run the same"
                " selection (the same --suite, -m, -k and --gpus). Refusing to run.")
    return ""


class Stream:
    """The event log of each node's local rank 0 (global rank 0 on one node): one JSON object
    per line, flushed and fsynced as written."""

    def __init__(self, path: Path, enabled: bool):
        self._file = path.open("a") if enabled else None

    def write(self, event: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=Path, required=True, help="JSON list of cell specs")
    parser.add_argument("--stream", type=Path, required=True, help="JSONL event file (local rank 0 of each node)")
    parser.add_argument("--expect-nnodes", type=int, default=1, help="nodes the process group must span")
    parser.add_argument("--memory-snapshot-dir", type=Path, default=None,
                        help="write each cell's memory timeline (and CUDA snapshot) here (module docstring)")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="write each cell's profiler trace of its timed steps here (measure/profiling.py)")
    add_run_options(parser.add_argument, "worker")  # the run's options every rank reads: the memory cap
    args = parser.parse_args()
    options = RunOptions.from_args(args, "worker")
    # A rank killed by a signal (a native extension's segfault) still leaves its Python stack
    # on stderr, which the launcher puts in the cell's record.
    faulthandler.enable()

    env = init_from_torchrun()
    if env.is_cuda:  # torch's defaults; a cell's allocator options decide (module docstring)
        torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
    if options.mem_cap_bytes and env.is_cuda:
        total = torch.cuda.get_device_properties(env.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, options.mem_cap_bytes / total), env.device)
    # Each node's launcher reads its own stream: which node holds global rank 0 is the
    # rendezvous's choice, and every rank sees the same gathered results anyway.
    stream = Stream(args.stream, enabled=int(os.environ.get("LOCAL_RANK", env.rank)) == 0)
    with entry.collector_paused():  # reading the cells imports their strategies' files and transformers
        cells = [CellSpec.from_dict(spec) for spec in json.loads(args.cells.read_text())]
    problem = world_problem(env, cells, args.expect_nnodes)
    if problem:
        print(f"shardbench worker: {problem}", file=sys.stderr, flush=True)
        for cell in cells:  # the reason becomes every cell's failure in the records
            stream.write({"event": "start", "cell_id": cell.cell_id})
            stream.write({"event": "done", "cell_id": cell.cell_id,
                          "per_rank": [{"rank": env.rank, "status": "failed", "reason": problem}]})
        dist.destroy_process_group()
        os._exit(0)
    release_memory(env.device)
    for n, cell in enumerate(cells, start=1):
        stream.write({"event": "start", "cell_id": cell.cell_id})
        try:
            result = {"status": "ok", "reason": "",
                      **run_cell(cell, env, options.mem_cap_bytes, args.memory_snapshot_dir, args.profile_dir)}
        except Exception as error:  # a failing cell is a result; the batch goes on
            # Also into the launch log: if the other ranks are stuck in a collective, the
            # gather below never completes and the log is where the launcher's timeout looks.
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
            # The cap's verdict is the whole story; anything else needs its traceback.
            tail = ([str(error)] if isinstance(error, MemoryCapExceeded)
                    else traceback.format_exc().strip().splitlines()[-TRACEBACK_LINES:])
            result = {"rank": env.rank, "status": outcome_of(error), "reason": "\n".join(tail),
                      "peak_reached_bytes": peak_reached(error, env)}
        per_rank: list[Any] = [None] * env.world_size  # every rank's result once gathered
        dist.all_gather_object(per_rank, result)
        stream.write({"event": "done", "cell_id": cell.cell_id, "per_rank": per_rank})
        if any(r["status"] != "ok" for r in per_rank):
            stream.write({"event": "restart"})
            break
        if n == len(cells):
            # No next cell to protect; and the launcher, holding every result, ends this
            # launch now: a collective here would race its kill ("connection reset by peer").
            break
        release_memory(env.device)
        if short := host_memory_short(cell, env):
            reason = (f"{short}, under {LOW_HOST_MEMORY_FRACTION:.0%}: the remaining cells run in fresh"
                      " processes")
            print(f"shardbench worker: {reason}", file=sys.stderr, flush=True)
            stream.write({"event": "restart", "reason": reason})
            break
    dist.destroy_process_group()
    # Some libraries abort in their destructors at interpreter exit after a good run
    # (DeepSpeed ZeRO-3: "terminate called without an active exception"); every result is
    # written by now, so leave without running them.
    os._exit(0)


if __name__ == "__main__":
    main()
