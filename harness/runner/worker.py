"""What every rank runs: a batch of cells in one process group, one after the other.

Launched by harness.runner.launcher through torchrun. For each cell: build the model, apply
checkpointing, wrap it for the strategy, then train ``cell.steps`` optimizer steps on the
same synthetic global batches the reference sees:

    warm-up (cell.warmup steps)  →  one memory-tracked step  →  one comm-counted step
    →  timed steps (cell.timed_steps)

Each probe gets a step of its own because both slow the step they watch. Rank 0 writes one
JSON line per event to the stream file (``start`` before a cell, ``done`` after it with
every rank's numbers), flushed at once, so the launcher can report progress and knows which
cell was running if the process dies. After a cell that failed on any rank, the process
group may be out of step (a rank left mid-collective), so the workers write ``restart`` and
leave; the launcher runs the remaining cells in a fresh launch.

Leak check: the memory held after the first timed step and after the last
(measure/memory.py ``live_bytes``), with the losses kept in a buffer made before the first
step so that keeping them costs nothing per step; the difference is ``memory_growth_bytes``.

With ``--memory-snapshot-dir`` the memory-tracked step also writes, per cell and rank, the
tracker's timeline as JSON (``<dir>/<cell>/rank<r>.json``: what the report charts) and on
CUDA the allocator's own snapshot beside it (``rank<r>.pickle``, for pytorch.org/memory_viz).

A cell with ``expandable_segments`` runs with the CUDA caching allocator's expandable
segments on (``expandable_segments:True``, set at run time: the allocator reads it whenever
it creates a segment, so the cache is emptied first and again after the cell, which sets it
back to False); the record says whether the step's segments really were expandable. Every
other cell runs without them, whatever PYTORCH_CUDA_ALLOC_CONF says: the worker switches them
off as it starts, so two records with one cell id never ran different allocators. (The
setter is torch's private ``_accelerator_setAllocatorSettings``, which the deprecated
``torch.cuda.memory._set_allocator_settings`` forwards to in 2.13.)

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
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from harness import models, strategies
from harness.config import CellSpec, RunOptions, add_run_options
from harness.distributed import DistEnv, init_from_torchrun
from harness.features import checkpointing, precision
from harness.measure import comm, memory, timing
from harness.runner import faults
from harness.strategies.base import Prepared

TRACEBACK_LINES = 15
# What the "leak" fault (faults.py) keeps from every timed step.
LEAK_BYTES_PER_STEP = 2**20


def local_batches(built: models.BuiltModel, cell: CellSpec, env: DistEnv, data_rank: int) -> list[list[dict]]:
    """Every step's micro-batches for this rank, drawn before anything is timed.

    The global batch of a step comes from a generator seeded with the cell's seed, never the
    global RNG, so every strategy and the reference see the same samples however they are
    split. Micro-step k of data-parallel group r (of D) takes rows [(k·D + r)·rows, +rows),
    where rows is the micro-batch (a pipeline's micro-step is all its micro-batches, which its
    schedule cuts up).
    """
    generator = torch.Generator().manual_seed(cell.seed)
    world = cell.strategy.data_parallel_size(cell.world_size)
    mb = cell.global_batch // (world * cell.strategy.accumulation)
    steps = []
    for _ in range(cell.steps):
        global_batch = built.make_batch(generator, cell.global_batch)
        micro_steps = []
        for k in range(cell.strategy.accumulation):
            start = (k * world + data_rank) * mb
            micro_steps.append({name: t[start : start + mb].to(env.device) for name, t in global_batch.items()})
        steps.append(micro_steps)
    return steps


def _no_op() -> None:
    pass


def train_step(built: models.BuiltModel, prep: Prepared, cell: CellSpec, env: DistEnv,
               micro_batches: list[dict], scaler: torch.amp.GradScaler,
               between_micro_steps: Callable[[], None] = _no_op,
               before_optimizer_step: Callable[[], None] = _no_op) -> torch.Tensor:
    """One optimizer step. Returns this rank's mean loss over its micro-batches (detached).

    ``before_optimizer_step`` runs after the last backward, before the optimizer (or the
    engine that owns it) steps. A rank that computes no loss (a pipeline's first stages)
    returns zero."""
    n_micro = len(micro_batches)
    total = torch.zeros((), device=env.device)
    for k, batch in enumerate(micro_batches):
        if k:
            between_micro_steps()
        last = k == n_micro - 1
        with nullcontext() if last else prep.no_sync():
            if prep.forward_backward is not None:  # a pipeline schedule does both
                with precision.autocast(cell.strategy.precision, env.device, enabled=prep.use_autocast):
                    loss = prep.forward_backward(batch)
                loss = torch.zeros((), device=env.device) if loss is None else loss
            else:
                with precision.autocast(cell.strategy.precision, env.device, enabled=prep.use_autocast):
                    loss = built.loss(prep.model, batch) / n_micro
                if prep.owns_optimizer_step:
                    prep.backward(loss)
                else:
                    scaler.scale(loss).backward()
        if last:
            before_optimizer_step()
        prep.after_micro_step()
        total += loss.detach().float()
    if not prep.owns_optimizer_step:
        scaler.step(prep.optimizer)
        scaler.update()
        prep.optimizer.zero_grad(set_to_none=prep.grads_set_to_none)
    return total


@dataclass
class PreparedCell:
    """A cell built and wrapped for its strategy, with every step's data: what a rank trains,
    and what harness/predict/traced.py runs under FakeTensorMode."""

    cell: CellSpec
    env: DistEnv
    built: models.BuiltModel
    prep: Prepared
    scaler: torch.amp.GradScaler
    batches: list[list[dict]]

    def step(self, i: int, between_micro_steps: Callable[[], None] = _no_op,
             before_optimizer_step: Callable[[], None] = _no_op) -> torch.Tensor:
        return train_step(self.built, self.prep, self.cell, self.env, self.batches[i], self.scaler,
                          between_micro_steps, before_optimizer_step)

    def tracked_step(self, i: int, timeline: bool = False) -> tuple[torch.Tensor, memory.StepMemory]:
        """Step ``i`` under the memory tracker: its loss and its StepMemory (with the
        tracker's timeline when ``timeline``)."""
        prep = self.prep
        with memory.track_step_memory(prep.memory_module or prep.model, prep.memory_optimizer or prep.optimizer,
                                      fsdp2=prep.fsdp2, device=self.env.device,
                                      held=prep.memory_held(), timeline=timeline) as probe:
            loss = self.step(i, probe.micro_step_boundary, probe.before_optimizer_step)
        return loss, probe.result()


def prepare_cell(cell: CellSpec, env: DistEnv) -> PreparedCell:
    built = models.build(models.get_preset(cell.model), seed=cell.seed, attention=cell.attention)
    checkpointing.apply_checkpointing(built.module, built.block_type, cell.strategy.checkpointing)
    prep = strategies.module(cell.strategy.name).prepare(built.module, built.block_type, cell, env)
    data_rank = env.rank if prep.data_rank is None else prep.data_rank
    return PreparedCell(cell=cell, env=env, built=built, prep=prep,
                        scaler=precision.grad_scaler(cell.strategy.precision, env.device),
                        batches=local_batches(built, cell, env, data_rank))


class MemoryCapExceeded(torch.OutOfMemoryError):
    """A CPU rank's step needed more than --mem-cap-gib."""

    def __init__(self, message: str, peak_reached_bytes: int):
        super().__init__(message)
        self.peak_reached_bytes = peak_reached_bytes


def enforce_cpu_memory_cap(peak_bytes: int, cap_bytes: int | None, env: DistEnv) -> None:
    """Raise MemoryCapExceeded on every rank when any rank's ``peak_bytes`` exceeds the cap.
    Every rank learns every peak first, so all of them leave the cell at the same point and
    none is left waiting in a collective of the next step."""
    if cap_bytes is None or env.is_cuda:  # CUDA: the allocator enforces it (main)
        return
    peaks: list[int | None] = [None] * env.world_size
    dist.all_gather_object(peaks, peak_bytes)
    over = [rank for rank, peak in enumerate(peaks) if peak > cap_bytes]
    if over:
        raise MemoryCapExceeded(
            f"out of memory under --mem-cap-gib {cap_bytes / 2**30:g} ({cap_bytes:,} B per rank): rank(s)"
            f" {', '.join(map(str, over))} peaked at {max(peaks):,} B in the memory-tracked step",
            peak_reached_bytes=max(peaks))


def peak_reached(error: BaseException, env: DistEnv) -> int | None:
    """The memory a rank had reached when ``error`` ended its cell, where that is known."""
    if isinstance(error, MemoryCapExceeded):
        return error.peak_reached_bytes
    if env.is_cuda and isinstance(error, torch.OutOfMemoryError):
        return torch.cuda.max_memory_allocated(env.device)  # reset as the cell began
    return None


def snapshot_files(snapshot_dir: Path, cell_id: str, rank: int) -> tuple[Path, Path]:
    """Where a rank writes a cell's timeline JSON and CUDA snapshot pickle."""
    folder = snapshot_dir / (re.sub(r"[^A-Za-z0-9._-]+", "_", cell_id).strip("._") or "cell")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"rank{rank}.json", folder / f"rank{rank}.pickle"


def write_memory_snapshot(mem: memory.StepMemory, timeline_file: Path, cell: CellSpec, env: DistEnv) -> dict:
    """The timeline as JSON next to the pickle; the record's fields naming both, relative to
    the run folder (the snapshot folder's parent)."""
    run_dir = timeline_file.parents[2]
    timeline_file.write_text(json.dumps({
        "cell_id": cell.cell_id, "rank": env.rank, "device": str(env.device), "tracker": mem.tracker,
        "truncated": mem.timeline_truncated, "events": mem.timeline,
    }))
    pickle_file = timeline_file.with_suffix(".pickle")
    return {
        "memory_timeline": str(timeline_file.relative_to(run_dir)),
        "memory_snapshot": str(pickle_file.relative_to(run_dir)) if pickle_file.exists() else None,
        "memory_snapshot_reason": "" if pickle_file.exists() else (
            "the CUDA allocator's snapshot exists only on CUDA; the timeline is the tracker's"),
    }


@contextmanager
def expandable_segments(enabled: bool, device: torch.device) -> Iterator[None]:
    """The cell under the caching allocator's expandable segments (module docstring)."""
    if not enabled:
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # segments made before keep their kind: start with none
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    try:
        yield
    finally:
        torch.cuda.synchronize(device)
        gc.collect()
        torch.cuda.empty_cache()
        torch._C._accelerator_setAllocatorSettings("expandable_segments:False")


def expandable_segments_in_use(device: torch.device) -> bool:
    """Whether any segment the allocator holds on ``device`` is an expandable one."""
    return any(segment.get("is_expandable") for segment in torch.cuda.memory_snapshot()
               if segment["device"] == device.index)


def run_cell(cell: CellSpec, env: DistEnv, mem_cap_bytes: int | None = None,
             snapshot_dir: Path | None = None) -> dict:
    """Train one cell and return this rank's measurements."""
    with expandable_segments(cell.expandable_segments and env.is_cuda, env.device):
        return _train_and_measure(cell, env, mem_cap_bytes, snapshot_dir)


def _train_and_measure(cell: CellSpec, env: DistEnv, mem_cap_bytes: int | None, snapshot_dir: Path | None) -> dict:
    faults.inject(cell.cell_id, env)
    if env.is_cuda:
        torch.cuda.reset_peak_memory_stats(env.device)  # an OOM reports this cell's peak
    session = prepare_cell(cell, env)
    built, prep = session.built, session.prep
    # The "leak" fault (faults.py) keeps a tensor from every timed step, as a leaking loop would.
    leaked: list[torch.Tensor] = []
    leak_bytes = LEAK_BYTES_PER_STEP if faults.planned().get(cell.cell_id) == "leak" else 0
    # Filled in place: a list of per-step losses would grow the memory the leak check watches.
    losses = torch.zeros(cell.steps, device=env.device)
    for i in range(cell.warmup):
        losses[i] = session.step(i)
    i = cell.warmup
    timeline_file, pickle_file = (snapshot_files(snapshot_dir, cell.cell_id, env.rank) if snapshot_dir
                                  else (None, None))
    with memory.cuda_memory_history(pickle_file) if env.is_cuda and pickle_file else nullcontext():
        losses[i], mem = session.tracked_step(i, timeline=timeline_file is not None)
    snapshot = (write_memory_snapshot(mem, timeline_file, cell, env) if timeline_file
                else {"memory_timeline": None, "memory_snapshot": None, "memory_snapshot_reason": "not asked for"})
    enforce_cpu_memory_cap(mem.peak_bytes, mem_cap_bytes, env)
    with comm.count_comm(env.device) as comm_stats:
        losses[i + 1] = session.step(i + 1)
    step_times: list[float] = []
    live_after: list[int] = []
    first_timed = cell.warmup + cell.probe_steps
    for i in range(first_timed, cell.steps):
        with timing.timed(env.device, step_times):
            losses[i] = session.step(i)
        if leak_bytes:
            leaked.append(torch.empty(leak_bytes, dtype=torch.uint8, device=env.device))
        if i in (first_timed, cell.steps - 1):
            gc.collect()  # what waits in reference cycles is not a leak
            live_after.append(memory.live_bytes(env.device))

    # The mean over the loss-holding ranks of their mean losses is the global mean loss
    # (equal-sized micro-batches, equal tokens per sample): the number the reference computes.
    # Ranks that split the model hold the same loss (tensor parallel) or none (a pipeline's
    # first stages): they count once each, or not at all.
    holds = float(prep.holds_loss)
    loss_tensor = torch.cat([losses * holds, torch.tensor([holds], device=env.device)])
    dist.all_reduce(loss_tensor)
    loss_tensor = loss_tensor[:-1] / loss_tensor[-1]
    return {
        "rank": env.rank,
        "peak_mem_bytes": mem.peak_bytes,
        "mem_breakdown_bytes": mem.breakdown_bytes,
        "rss_peak_bytes": mem.rss_peak_bytes,
        "cuda_memory": mem.cuda,
        "memory_tracker": mem.tracker,
        "at_optimizer_step_bytes": mem.at_optimizer_step_bytes,
        "async_freed_bytes": mem.async_freed_bytes,
        **snapshot,
        "memory_growth_bytes": growth(live_after),
        "memory_growth_steps": cell.steps - 1 - first_timed,
        "live_bytes_measure": "cuda_memory_allocated" if env.is_cuda else "python_tensor_bytes",
        "expandable_segments": expandable_segments_in_use(env.device) if env.is_cuda else None,
        # fp32 matmuls on TF32 tensor cores ("high", "medium") have another peak (flops.py).
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "step_times_s": step_times,
        "comm_by_op": {op: stats.to_record() for op, stats in comm_stats().items()},
        "engine": prep.engine_report(),
        "losses": loss_tensor.tolist(),
        "n_params": built.n_params,
        "attn_implementation": built.attn_implementation,
        "tokens_per_sample": built.tokens_per_sample,
        "flops_per_sample": built.flops_per_sample,
    }


def growth(live_after: list[int]) -> int | None:
    """Bytes held after the last timed step beyond those held after the first; None when
    there was one timed step."""
    if len(live_after) < 2:
        return None
    return live_after[-1] - live_after[0]


def outcome_of(error: BaseException) -> str:
    # CUDA raises OutOfMemoryError; the CPU allocator a RuntimeError that says so.
    if isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error):
        return "oom"
    return "failed"


def release_memory(device: torch.device) -> None:
    """Give back what the finished cell held so the next cell's peak starts from the floor."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass  # not glibc: RSS stays higher, tensor-byte measurements are unaffected


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
    add_run_options(parser.add_argument, "worker")  # the run's options every rank reads: the memory cap
    args = parser.parse_args()
    options = RunOptions.from_args(args, "worker")
    # A rank killed by a signal (a native extension's segfault) still leaves its Python stack
    # on stderr, which the launcher puts in the cell's record.
    faulthandler.enable()

    env = init_from_torchrun()
    if env.is_cuda:  # the cells' expandable_segments option decides (module docstring)
        torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
    if options.mem_cap_bytes and env.is_cuda:
        total = torch.cuda.get_device_properties(env.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, options.mem_cap_bytes / total), env.device)
    # Each node's launcher reads its own stream: which node holds global rank 0 is the
    # rendezvous's choice, and every rank sees the same gathered results anyway.
    stream = Stream(args.stream, enabled=int(os.environ.get("LOCAL_RANK", env.rank)) == 0)
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
    for cell in cells:
        stream.write({"event": "start", "cell_id": cell.cell_id})
        try:
            result = {"status": "ok", "reason": "",
                      **run_cell(cell, env, options.mem_cap_bytes, args.memory_snapshot_dir)}
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
        per_rank: list[dict | None] = [None] * env.world_size
        dist.all_gather_object(per_rank, result)
        stream.write({"event": "done", "cell_id": cell.cell_id, "per_rank": per_rank})
        if any(r["status"] != "ok" for r in per_rank):
            stream.write({"event": "restart"})
            break
        release_memory(env.device)
    dist.destroy_process_group()
    # Some libraries abort in their destructors at interpreter exit after a good run
    # (DeepSpeed ZeRO-3: "terminate called without an active exception"); every result is
    # written by now, so leave without running them.
    os._exit(0)


if __name__ == "__main__":
    main()
