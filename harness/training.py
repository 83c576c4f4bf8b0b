"""The training step every rank runs, and the order a cell is measured in, top to bottom.

A cell's model is built, given activation checkpointing and prepared for its strategy
(``prepare_cell``), then trained ``cell.steps`` optimizer steps (``train_step``) on the same
synthetic global batches the reference sees (``local_batches``), in this order (``run_cell``):

    warm-up (cell.warmup steps)  →  one memory-tracked step  →  one comm-counted step
    →  timed steps (cell.timed_steps)

Each probe gets a step of its own because both slow the step they watch. The worker
(harness/runner/worker.py) runs ``run_cell`` on every rank of a torchrun launch; the traced
predictor (harness/predict/traced.py) runs ``prepare_cell``, the warm-up and the
memory-tracked step under FakeTensorMode. Nothing here knows about torchrun or the runner.

Leak check: the memory held after the first timed step and after the last
(measure/memory.py ``live_bytes``), with the losses kept in a buffer made before the first
step so that keeping them costs nothing per step; the difference is ``memory_growth_bytes``.

With a snapshot folder (the worker's ``--memory-snapshot-dir``) the memory-tracked step also
writes, per cell and rank, the tracker's timeline as JSON (``<dir>/<cell>/rank<r>.json``: what
the report charts) and on CUDA the allocator's own snapshot beside it (``rank<r>.pickle``, for
pytorch.org/memory_viz).

A cell with allocator settings (``expandable_segments``, ``max_split_size_mb``,
``garbage_collection_threshold``: CellSpec.allocator_settings) runs under them, set at run
time: the allocator reads them as it creates and splits segments, so the cache is emptied
first and again after the cell, which sets ``expandable_segments:False`` back (each call
resets every setting it does not name to torch's default). The record keeps the settings
the allocator reported during the cell and whether the step's segments really were
expandable. Every other cell runs with the defaults, whatever PYTORCH_CUDA_ALLOC_CONF says:
the worker makes the same call as it starts, so two records with one cell id never ran
different allocators. The garbage-collection threshold acts only where a memory fraction is
set (the caching allocator's rule): a cell with one and no memory cap gets the whole device
as its fraction (1.0). (The setter is torch's private ``_accelerator_setAllocatorSettings``,
which the deprecated ``torch.cuda.memory._set_allocator_settings`` forwards to in 2.13.)

A memory cap (``mem_cap_bytes``, harness/runner/worker.py says what it is) is enforced here
on the CPU only, where no allocator limit can be set: against the memory-tracked step's peak,
on every rank together (``enforce_cpu_memory_cap``).
"""

from __future__ import annotations

import gc
import json
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness import data, faults, models, strategies
from harness.config import REFERENCE, CellSpec
from harness.distributed import DistEnv
from harness.features import checkpointing, clipping, precision
from harness.measure import batch_norm, comm, expert_load, memory, numerics, profiling, timing
from harness.strategies.base import Prepared


def local_batches(built: models.BuiltModel, cell: CellSpec, env: DistEnv,
                  data_rank: int) -> list[list[dict[str, torch.Tensor]]]:
    """Every step's micro-batches for this rank, drawn before anything is timed.

    The global batch of a step comes from a generator seeded with the cell's seed, never the
    global RNG, so every strategy and the reference see the same samples however they are
    split. Micro-step k of data-parallel group r (of D) takes rows [(k·D + r)·rows, +rows),
    where rows is the micro-batch (a pipeline's micro-step is all its micro-batches, which its
    schedule cuts up).

    Real data (``cell.data``) comes through the rank's DistributedSampler and DataLoader
    (harness/data.py), whose micro-batches make the same global batches.
    """
    world = cell.strategy.data_parallel_size(cell.world_size)
    mb = cell.global_batch // (world * cell.strategy.accumulation)
    accumulation = cell.strategy.accumulation
    if cell.data != "synthetic":
        train, _, _ = data.splits(cell.data, cell.model_spec.seq_len)
        loaded = data.sampler_batches(train, mb, cell.steps * accumulation, world, data_rank, cell.seed)
        on_device = [{name: t.to(env.device) for name, t in batch.items()} for batch in loaded]
        return [on_device[i:i + accumulation] for i in range(0, len(on_device), accumulation)]
    generator = torch.Generator().manual_seed(cell.seed)
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
               micro_batches: list[dict[str, torch.Tensor]], scaler: torch.amp.GradScaler,
               between_micro_steps: Callable[[], None] = _no_op,
               before_optimizer_step: Callable[[], None] = _no_op,
               grad_norm_into: torch.Tensor | None = None, unscale_before_clip: bool = True,
               kept_graphs: list[torch.Tensor] | None = None) -> torch.Tensor:
    """One optimizer step. Returns this rank's mean loss over its micro-batches (detached).

    ``before_optimizer_step`` runs after the last backward, before the gradients are
    unscaled and clipped and the optimizer (or the engine that owns it) steps. The gradients'
    global norm before clipping is copied into ``grad_norm_into`` where given (it is computed
    anyway where the cell clips). ``unscale_before_clip=False`` is the ``clip_before_unscale``
    fault (features/clipping.py). ``kept_graphs`` is the ``retained_graph`` fault: each
    loss kept, its graph retained (harness/faults.py). A rank that computes no loss (a
    pipeline's first stages) returns zero."""
    n_micro = len(micro_batches)
    total = torch.zeros((), device=env.device)
    for k, batch in enumerate(micro_batches):
        if k:
            between_micro_steps()
        last = k == n_micro - 1
        with prep.loss_context(), nullcontext() if last else prep.no_sync():
            if prep.forward_backward is not None:  # a pipeline schedule does both
                with precision.autocast(cell.strategy.precision, env.device, enabled=prep.use_autocast):
                    loss = prep.forward_backward(batch)
                loss = torch.zeros((), device=env.device) if loss is None else loss
            else:
                with precision.autocast(cell.strategy.precision, env.device, enabled=prep.use_autocast):
                    loss = built.loss(prep.model, batch) / n_micro
                if prep.backward is not None:  # prep.owns_optimizer_step
                    prep.backward(loss)
                else:
                    scaler.scale(loss).backward(retain_graph=kept_graphs is not None)
                    if kept_graphs is not None:
                        kept_graphs.append(loss)
        if last:
            before_optimizer_step()
        prep.after_micro_step()
        total += loss.detach().float()
    if not prep.owns_optimizer_step:
        max_norm = cell.strategy.clip_grad_norm
        if max_norm is not None or grad_norm_into is not None:
            if unscale_before_clip:
                scaler.unscale_(prep.optimizer)  # the AMP recipe: clip the true gradients
            clip = prep.clip_grad_norm or clipping.torch_clip(prep.model.parameters())
            norm = clip(math.inf if max_norm is None else max_norm)
            if grad_norm_into is not None:
                grad_norm_into.copy_(norm)
        scaler.step(prep.optimizer)  # unscales first where nothing above did
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
    batches: list[list[dict[str, torch.Tensor]]]
    # Each step's gradient norm before clipping, NaN where the step measured none; filled in
    # place, as the losses are (run_cell).
    grad_norms: torch.Tensor
    # The held-out set's batches (real data only: harness/data.py), on the device.
    held_out: list[dict[str, torch.Tensor]]
    unscale_before_clip: bool = True
    kept_graphs: list[torch.Tensor] | None = None  # the retained_graph fault (harness/faults.py)
    # The engine's kept buffers seen by the last warm-up step's all-reduces (Prepared.
    # all_reduces_kept_buffers), for the memory step.
    kept_buffers: list[torch.Tensor] = field(default_factory=list)
    # A mixture of experts' tokens per expert, counted in every step where every rank runs
    # every layer on its own tokens (measure/expert_load.py); None otherwise.
    expert_load: expert_load.ExpertLoad | None = None

    def step(self, i: int, between_micro_steps: Callable[[], None] = _no_op,
             before_optimizer_step: Callable[[], None] = _no_op, measure_grad_norm: bool = False) -> torch.Tensor:
        """Step ``i``. Its gradient norm is kept where the cell clips (computed anyway) or
        ``measure_grad_norm`` asks for it (measure/numerics.py says which steps do) and the
        strategy can take the global norm: those that cannot clip (Megatron's splits) would
        give each rank's own part of it."""
        # (In backward, no moment holds every gradient to take the norm of.)
        can_norm = (strategies.get(self.cell.strategy.name).capabilities.clipping
                    and not self.cell.strategy.optimizer_in_backward)
        keep_norm = self.cell.strategy.clip_grad_norm is not None or (measure_grad_norm and can_norm)
        if self.expert_load is not None:
            self.expert_load.step = i
        empty_cache = self.cell.empty_cache
        if empty_cache == "micro_step":
            between_micro_steps = _then(between_micro_steps, torch.cuda.empty_cache)
        loss = train_step(self.built, self.prep, self.cell, self.env, self.batches[i], self.scaler,
                          between_micro_steps, before_optimizer_step,
                          grad_norm_into=self.grad_norms[i] if keep_norm else None,
                          unscale_before_clip=self.unscale_before_clip, kept_graphs=self.kept_graphs)
        if empty_cache != "never":  # what the loop's users call after a step (README "Allocator control")
            torch.cuda.empty_cache()
        return loss

    def evaluates_after(self, steps_done: int) -> bool:
        """Whether the held-out loss is taken after ``steps_done`` steps: before the first, every
        ``eval_every`` and after the last."""
        every = self.cell.eval_every
        return bool(self.held_out) and (steps_done in (0, self.cell.steps)
                                        or (every is not None and steps_done % every == 0))

    def evaluate(self) -> tuple[float, float | None]:
        """The mean loss over the held-out set, which every rank evaluates whole (its forward
        may need every rank: FSDP's gathers), in the cell's precision and in eval mode
        (BatchNorm normalises by its running statistics); and a classifier's accuracy on it
        (None for other models)."""
        total, right, samples = torch.zeros((), device=self.env.device), torch.zeros((), device=self.env.device), 0
        counted = True
        self.prep.model.eval()
        with torch.no_grad(), self.prep.loss_context(), precision.autocast(
                self.cell.strategy.precision, self.env.device, enabled=self.prep.use_autocast):
            for batch in self.held_out:
                n = len(next(iter(batch.values())))
                loss, correct = self.built.loss_and_correct(self.prep.model, batch)
                total += loss.float() * n
                if correct is None:
                    counted = False
                else:
                    right += correct
                samples += n
        self.prep.model.train()
        return (total / samples).item(), (right / samples).item() if counted else None

    def last_warmup_step(self, i: int, **step_options: Any) -> torch.Tensor:
        """Step ``i``, the last before the memory step, taking the engine's kept buffers from
        its all-reduces where the strategy says they are such (Prepared.all_reduces_kept_buffers)."""
        if not self.prep.all_reduces_kept_buffers:
            return self.step(i, **step_options)
        with memory.all_reduced_buffers() as buffers:
            loss = self.step(i, **step_options)
        self.kept_buffers = buffers
        return loss

    def gradient_range_unmeasured(self) -> str:
        """Why this cell's gradients are not held against its precision's range ("" when they are)."""
        if self.cell.strategy.precision == "fp32":
            return "fp32 throughout: no cast to a narrower range"
        if self.prep.owns_optimizer_step:
            return ("DeepSpeed keeps the gradients in its optimizer's flat partitions, not in the"
                    " parameters' .grad, where this probe reads them")
        if self.cell.strategy.optimizer_in_backward:
            return "the optimizer runs in backward: each gradient is freed as soon as it is applied"
        return ""

    def gradient_range(self) -> dict[str, Any]:
        """The gradients this rank's optimizer steps, as backward left them, against the compute
        precision's range (measure/numerics.py); call after the last backward of a step."""
        optimizer = self.prep.memory_optimizer or self.prep.optimizer
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        return numerics.gradient_range(grads, precision.DTYPES[self.cell.strategy.precision], scale, self.env.device)

    def log_numerics(self, log: numerics.NumericsLog, i: int) -> None:
        """Step ``i``'s loss scale, skip and (an engine's own) gradient norm into ``log``."""
        if self.prep.engine_numerics is not None:
            log.after_engine_step(i, *self.prep.engine_numerics())
        else:
            log.after_harness_step(i)

    def tracked_step(self, i: int, timeline: bool = False) -> tuple[torch.Tensor, memory.StepMemory]:
        """Step ``i`` under the memory tracker: its loss and its StepMemory (with the
        tracker's timeline when ``timeline``)."""
        prep = self.prep
        with memory.track_step_memory(prep.memory_module or prep.model, prep.memory_optimizer or prep.optimizer,
                                      fsdp2=prep.fsdp2, device=self.env.device,
                                      held=[*prep.memory_held(), *self.kept_buffers], timeline=timeline,
                                      block_type=self.built.block_type) as probe:
            loss = self.step(i, probe.micro_step_boundary, probe.before_optimizer_step)
        return loss, probe.result()

    def counted_step(self, i: int) -> tuple[torch.Tensor, comm.CommStep]:
        """Step ``i`` with its collectives counted: its loss and, per collective kind, the
        count, bytes and time, and how much of their time compute hid. The one-process
        reference has none: its step runs without the profiler that counting takes (a sixth
        of a second a step on this project's CPU hosts). DataParallel, one process too,
        broadcasts and reduces over its GPUs' NCCL, and is counted."""
        if self.cell.strategy.name == REFERENCE:
            return self.step(i), comm.NO_COLLECTIVES
        with comm.count_comm(self.env.device) as comm_stats:
            loss = self.step(i)
        return loss, comm_stats()


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


def prepare_cell(cell: CellSpec, env: DistEnv) -> PreparedCell:
    """The cell's model built, checkpointed and wrapped by its strategy, and this rank's
    batches (a strategy that splits the batch its own way names this rank's data rank)."""
    built = models.build(cell.model_spec, seed=cell.seed, attention=cell.attention,
                         router_aux_loss_coef=cell.router_aux_loss_coef)
    n_blocks = cell.model_spec.n_layers
    checkpointing.apply_checkpointing(built.module, built.block_type, cell.strategy.checkpointing,
                                      cell.strategy.blocks("checkpoint_blocks", n_blocks))
    prep = strategies.get(cell.strategy.name).prepare(built.module, built.block_type, cell, env)
    if prep.use_autocast and cell.strategy.fp32_blocks:  # an engine casting the model keeps them its own way
        fp32 = cell.strategy.blocks("fp32_blocks", n_blocks)
        blocks = [module for module in built.module.modules() if isinstance(module, built.block_type)]
        precision.keep_blocks_fp32([block for i, block in enumerate(blocks) if i in fp32], env.device)
    data_rank = env.rank if prep.data_rank is None else prep.data_rank
    routers = expert_load.routers(built.module) if cell.model_spec.family == "moe" else []
    load = (expert_load.ExpertLoad(routers, cell.steps, env.device)
            if routers and cell.strategy.data_parallel_size(cell.world_size) == cell.world_size else None)
    held_out = ([{name: t.to(env.device) for name, t in batch.items()}
                 for batch in data.eval_batches(data.splits(cell.data, cell.model_spec.seq_len)[1])]
                if cell.data != "synthetic" else [])
    return PreparedCell(cell=cell, env=env, built=built, prep=prep,
                        scaler=prep.scaler or precision.grad_scaler(cell.strategy, env.device),
                        batches=local_batches(built, cell, env, data_rank),
                        grad_norms=torch.full((cell.steps,), math.nan, device=env.device),
                        held_out=held_out, expert_load=load,
                        unscale_before_clip=faults.planned().get(cell.cell_id) != faults.CLIP_BEFORE_UNSCALE)


def leak_faults(session: PreparedCell) -> list[Any]:
    """What the leak faults (harness/faults.py) keep from the timed steps on: a list the
    caller holds (``leak``'s tensors, ``hook_reference``'s outputs) while they run; a hook
    kept by a reference to the model, or the retained graphs in the session."""
    fault, kept = faults.planned().get(session.cell.cell_id), []
    if fault == faults.HOOK_REFERENCE:
        session.built.module.register_forward_hook(lambda module, inputs, output: kept.append(output))
    elif fault == faults.RETAINED_GRAPH:
        session.kept_graphs = []
    return kept


def run_cell(cell: CellSpec, env: DistEnv, mem_cap_bytes: int | None = None,
             snapshot_dir: Path | None = None, profile_dir: Path | None = None) -> dict[str, Any]:
    """Train one cell and return this rank's measurements (with ``profile_dir``, its timed
    steps under torch.profiler: measure/profiling.py)."""
    with allocator_settings(cell.allocator_settings if env.is_cuda else "", env.device,
                            fraction_set=mem_cap_bytes is not None):
        return _train_and_measure(cell, env, mem_cap_bytes, snapshot_dir, profile_dir)


def _train_and_measure(cell: CellSpec, env: DistEnv, mem_cap_bytes: int | None,
                       snapshot_dir: Path | None, profile_dir: Path | None) -> dict[str, Any]:
    warmup = cell.warmup_steps
    faults.inject(cell.cell_id, env)  # nothing unless SHARDBENCH_FAULT names this cell
    if env.is_cuda:
        torch.cuda.reset_peak_memory_stats(env.device)  # an OOM reports this cell's peak
    session = prepare_cell(cell, env)
    built, prep = session.built, session.prep
    # The "leak" fault (harness/faults.py) keeps a tensor from every timed step, as a leaking
    # loop would; without it nothing is kept.
    leak_bytes = faults.LEAK_BYTES_PER_STEP if faults.planned().get(cell.cell_id) == faults.LEAK else 0
    # Filled in place: a list of per-step losses would grow the memory the leak check watches.
    losses = torch.zeros(cell.steps, device=env.device)
    log = numerics.NumericsLog(cell.steps, session.scaler)
    range_unmeasured = session.gradient_range_unmeasured()
    grad_range: dict[str, Any] | None = None

    held_out: list[list[float]] = []  # [steps done, held-out loss]
    accuracy: list[list[float]] = []  # [steps done, held-out accuracy] (classifiers)

    def evaluate(steps_done: int) -> None:
        loss, right = session.evaluate()
        held_out.append([steps_done, loss])
        if right is not None:
            accuracy.append([steps_done, right])

    def probe_gradient_range() -> None:
        nonlocal grad_range
        grad_range = session.gradient_range()

    def after_step(i: int) -> None:
        """Outside any measured step: step ``i``'s numerics, and the held-out loss when due."""
        session.log_numerics(log, i)
        if session.evaluates_after(i + 1):
            evaluate(i + 1)

    if session.evaluates_after(0):
        evaluate(0)

    # Warm-up, not measured: the first steps make what later steps reuse (optimizer state,
    # allocator caches, DDP's rebuilt buckets). They measure the gradient norm, and the last
    # one how the gradients fall in the compute precision's range.
    for i in range(warmup):
        last = i == warmup - 1
        probe = probe_gradient_range if last and not range_unmeasured else _no_op
        step = session.last_warmup_step if last else session.step
        losses[i] = step(i, before_optimizer_step=probe, measure_grad_norm=True)
        after_step(i)

    # The memory-tracked step; with a snapshot folder, also its timeline (and CUDA's snapshot).
    i = warmup
    timeline_file, pickle_file = (snapshot_files(snapshot_dir, cell.cell_id, env.rank) if snapshot_dir
                                  else (None, None))
    with memory.cuda_memory_history(pickle_file) if env.is_cuda and pickle_file else nullcontext():
        losses[i], mem = session.tracked_step(i, timeline=timeline_file is not None)
    after_step(i)
    snapshot = (write_memory_snapshot(mem, timeline_file, cell, env) if timeline_file
                else {"memory_timeline": None, "memory_snapshot": None, "memory_snapshot_reason": "not asked for"})
    enforce_cpu_memory_cap(mem.peak_bytes, mem_cap_bytes, env)

    # The comm-counted step.
    losses[i + 1], comm_step = session.counted_step(i + 1)
    after_step(i + 1)

    # The timed steps; the memory held after the first and after the last is the leak check.
    step_times: list[float] = []
    live_after: list[int] = []
    first_timed = warmup + cell.probe_steps
    leaked = leak_faults(session)  # empty unless a leak fault names this cell
    with profiling.profiled(cell_folder(profile_dir, cell.cell_id) if profile_dir else None, env.rank,
                            env.is_cuda) as profile:
        for i in range(first_timed, cell.steps):
            with timing.timed(env.device, step_times):
                losses[i] = session.step(i)
            if leak_bytes:
                leaked.append(torch.empty(leak_bytes, dtype=torch.uint8, device=env.device))
            if i in (first_timed, cell.steps - 1):
                gc.collect()  # what waits in reference cycles is not a leak
                live_after.append(memory.live_bytes(env.device))
            after_step(i)

    # The mean over the loss-holding ranks of their mean losses is the global mean loss
    # (equal-sized micro-batches, equal tokens per sample): the number the reference computes.
    # Ranks that split the model hold the same loss (tensor parallel) or none (a pipeline's
    # first stages): they count once each, or not at all.
    holds = float(prep.holds_loss)
    loss_tensor = torch.cat([losses * holds, torch.tensor([holds], device=env.device)])
    dist.all_reduce(loss_tensor)
    loss_tensor = loss_tensor[:-1] / loss_tensor[-1]
    log.set_grad_norms(session.grad_norms.tolist())
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
        "allocator_settings": torch._C._accelerator_getAllocatorSettings() if env.is_cuda else None,
        # fp32 matmuls on TF32 tensor cores ("high", "medium") have another peak (flops.py).
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "step_times_s": step_times,
        "module_memory": mem.modules,
        **profile,
        "comm_by_op": {op: stats.to_record() for op, stats in comm_step.by_op.items()},
        "comm_exposure": comm_step.exposure.to_record(),
        "engine": prep.engine_report(),
        "losses": loss_tensor.tolist(),
        "numerics": log.to_record(grad_range, range_unmeasured),
        "evaluation": ({"data": data.splits(cell.data, cell.model_spec.seq_len)[2], "every": cell.eval_every,
                        "held_out_loss": held_out, "held_out_accuracy": accuracy or None} if held_out else None),
        "batch_norm": batch_norm.record(cell, built.module),
        "expert_load": (session.expert_load.to_record(summed_over_ranks=True) if session.expert_load
                        else {"not_measured": expert_load.NOT_MEASURED} if cell.model_spec.family == "moe" else None),
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


class MemoryCapExceeded(torch.OutOfMemoryError):
    """A CPU rank's step needed more than --mem-cap-gib."""

    def __init__(self, message: str, peak_reached_bytes: int):
        super().__init__(message)
        self.peak_reached_bytes = peak_reached_bytes


def enforce_cpu_memory_cap(peak_bytes: int, cap_bytes: int | None, env: DistEnv) -> None:
    """Raise MemoryCapExceeded on every rank when any rank's ``peak_bytes`` exceeds the cap.
    Every rank learns every peak first, so all of them leave the cell at the same point and
    none is left waiting in a collective of the next step."""
    if cap_bytes is None or env.is_cuda:  # CUDA: the allocator enforces it (the worker sets it)
        return
    peaks = [0] * env.world_size  # every entry is replaced by a rank's peak
    dist.all_gather_object(peaks, peak_bytes)
    over = [rank for rank, peak in enumerate(peaks) if peak > cap_bytes]
    if over:
        raise MemoryCapExceeded(
            f"out of memory under --mem-cap-gib {cap_bytes / 2**30:g} ({cap_bytes:,} B per rank): rank(s)"
            f" {', '.join(map(str, over))} peaked at {max(peaks):,} B in the memory-tracked step",
            peak_reached_bytes=max(peaks))


def cell_folder(root: Path, cell_id: str) -> Path:
    """A cell's folder under ``root`` (memory snapshots, profiler traces): its id, file-safe."""
    return root / (re.sub(r"[^A-Za-z0-9._-]+", "_", cell_id).strip("._") or "cell")


def snapshot_files(snapshot_dir: Path, cell_id: str, rank: int) -> tuple[Path, Path]:
    """Where a rank writes a cell's timeline JSON and CUDA snapshot pickle."""
    folder = cell_folder(snapshot_dir, cell_id)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"rank{rank}.json", folder / f"rank{rank}.pickle"


def write_memory_snapshot(mem: memory.StepMemory, timeline_file: Path, cell: CellSpec,
                          env: DistEnv) -> dict[str, str | None]:
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
def allocator_settings(settings: str, device: torch.device, fraction_set: bool = False) -> Iterator[None]:
    """The cell under the caching allocator's ``settings`` (module docstring); "" for torch's
    defaults, as the worker left them. ``fraction_set``: a memory cap set the device's
    memory fraction (worker.py)."""
    if not settings:
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # segments made before keep their kind: start with none
    torch._C._accelerator_setAllocatorSettings(settings)
    if "garbage_collection_threshold" in settings and not fraction_set:
        torch.cuda.set_per_process_memory_fraction(1.0, device)  # the threshold acts only under one
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
