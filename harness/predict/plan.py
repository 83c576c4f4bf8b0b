"""``python -m harness plan``: which configuration to rent the GPUs for, before renting them.

For one model, GPU count and memory budget, every strategy and sensible option combination
(activation checkpointing or offload, parameter and optimizer offload; tp_fsdp's 2-D layout at
each tensor-parallel degree within a node; the pipelines over every GPU, PLANNED_PIPELINES) at
the chosen precision and optimizer, each
training the same global batch, with the analytic predictor's peak per GPU and its breakdown,
whether it fits, the communication per step, and the predicted step time, tokens/s and MFU
(harness/predict/rough_time.py: the step-time predictor at datasheet rates, each assumption
stated there, or, with ``--calibration``, at the rates a run measured on the user's own
device, each configuration's work traced from its first blocks, predict/plan_work.py, and the
run's own measured step beside each configuration it ran). A configuration fits when its
peak is within ``fit.USABLE_FRACTION`` of the GPU's memory (the rest is the headroom the CUDA
context, NCCL and the allocator's fragmentation take) and, where the request gives a node's
host memory, what its offload holds there, every local rank's share, is within
``fit.HOST_USABLE_FRACTION`` of it. The recommendation is the fastest
fitting configuration by the predicted step time; between equal times, the order a
practitioner would try them — no offload before offload, less recomputation before more.

With ``--global-batch`` (samples per optimizer step over every GPU) each configuration trains
that batch: at ``--micro-batch``, accumulating the rest, or, without it, at the largest
power-of-two micro-batch whose analytic peak fits (fit.sized, the rule the GPU matrix sizes its
cells by), so that a configuration that holds less per sample takes fewer, larger micro-steps.
The step time is then the optimizer step's, the engines' per-micro-step communication (FSDP
and ZeRO-3's gathers, DeepSpeed ZeRO-2's reductions) repeated in it. A traced peak over the
memory makes a configuration no fit at its micro-batch; a smaller one is not tried. Its trace
accumulates over two micro-steps at most (``peak_traced_as``): the second holds every later
one's peak.

``--traced`` also traces, under FakeTensorMode (harness/predict/traced.py: exact
per-category peak of the real model and strategy at the real world size, for models up to
about 10B parameters on a CPU host; with CUDA's attention kernels, as the CLI passes
``kernels="cuda"``), the ``TRACED_CANDIDATES`` fastest fitting
configurations and the one the user names (``--config``); a traced peak over the usable
memory is not a fit, nor is a configuration whose trace raises what a real run raises too
(traced.FAILS_FOR_REAL: DeepSpeed ZeRO-3 with selective checkpointing at real size), and the
next fastest is traced until the recommendation's trace fits.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import get_args

from harness import models, strategies
from harness.config import (
    MAX_COUNT,
    Attention,
    CellSpec,
    Checkpointing,
    Offload,
    Optimizer,
    Precision,
    StrategySpec,
)
from harness.measure import flops
from harness.predict import analytic, fit, plan_work, rough_time

# The data-parallel and sharded strategies the formulas describe, as their engines'
# maintainers recommend them (no superseded engine), the reference aside.
PLANNED_STRATEGIES = tuple(s.name for s in strategies.declarations()
                           if s.engine_model.analytic == "data_parallel" and s.superseded_by is None
                           and s.splits_batch and "reference" not in s.families)
# tp_fsdp, torchtitan's 2-D layout (tensor parallel inside each group of tp_degree GPUs, FSDP2
# over the groups), at every power-of-two degree within a node (``tp_degrees``): its
# collectives wait between a block's matmuls, which is why Megatron-LM and torchtitan keep the
# tensor-parallel group on NVLink. A group takes one micro-batch between its GPUs, so it lets
# a global batch smaller than the GPU count train, and splits what a sample's blocks hold.
# With torchtitan's plan options: the sequence split between the blocks' regions and the
# vocabulary split (the same bytes moved as without them, and the residual stream, norms,
# embedding, head and logits divided by the degree).
PLANNED_TENSOR_PARALLEL = "tp_fsdp"
# Pipelines over every GPU (torch.distributed.pipelining, one stage a GPU or two interleaved),
# for the causal LMs the split is written for: 1F1B, which holds at most p micro-batches in
# flight where GPipe, at the same bubble, holds them all (Narayanan et al. 2021), and
# interleaved 1F1B, whose bubble is v times smaller. The step's samples are the schedule's
# micro-batches, of --micro-batch or 1 sample: the most micro-batches, so the smallest bubble,
# and 1F1B holds no more in flight for them.
PLANNED_PIPELINES = ("pp_1f1b", "pp_interleaved_1f1b")
# Activation offload last: its copies cross PCIe every micro-step (the step time prices them).
CHECKPOINTING_ORDER: tuple[Checkpointing, ...] = ("none", "selective", "full", "offload")
OFFLOAD_ORDER: tuple[Offload, ...] = ("none", "params", "optimizer", "optimizer_params")
TRACED_CANDIDATES = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str | models.ModelSpec  # a preset's name, or a resolved config (harness.models.sources)
    gpus: int
    gpu_mem_bytes: float
    nodes: int = 1
    seq: int | None = None
    # None: 1, or with global_batch each configuration's largest that fits (fit.sized).
    micro_batch: int | None = None  # samples a micro-step per GPU, or per tensor-parallel group under tp_fsdp
    global_batch: int | None = None  # samples per optimizer step over every GPU; None: one micro-batch each
    precision: Precision = "bf16"
    optimizer: Optimizer = "adamw"
    attention: Attention | None = None  # None: the model's own (``model_attention``)
    host_mem_bytes: float | None = None  # a node's host memory (--host-mem); None: offload's need is not checked
    # What a node's network sends to the others, B/s (--inter-node-bw); None: rough_time's assumption.
    inter_node_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, str):
            models.get_preset(self.model)  # raises with the allowed names
        # A count past a cell's bounds would make every candidate an invalid cell, and "nothing
        # fits" would be the answer to a typo.
        for flag, value in (("--gpus", self.gpus), ("--nodes", self.nodes), ("--micro-batch", self.micro_batch),
                            ("--seq", self.seq), ("--global-batch", self.global_batch)):
            if value is not None and not 1 <= value <= MAX_COUNT:
                raise ValueError(f"{flag} {value}: must be at least 1 and at most {MAX_COUNT:,}")
        if self.gpus % self.nodes:
            raise ValueError(f"--gpus {self.gpus} is not divisible by --nodes {self.nodes}:"
                             " every node runs the same number of GPUs")
        if self.inter_node_bytes_per_s is not None and self.nodes < 2:
            raise ValueError("--inter-node-bw prices what crosses nodes: it applies to a plan over several --nodes")
        if self.optimizer not in get_args(Optimizer):
            raise ValueError(f"--optimizer {self.optimizer}: choose one of {', '.join(get_args(Optimizer))}")
        spec = self.model if isinstance(self.model, models.ModelSpec) else models.get_preset(self.model)
        if self.seq is not None and spec.seq_len is None:
            raise ValueError(f"--seq applies to text models; {spec.name} is a {spec.family} model")
        try:
            spec = self.spec  # the model's own bounds on the sequence (its position embeddings) checked
        except ValueError as error:
            raise ValueError(f"--seq: {error}") from None
        if self.attention is not None:
            if self.attention not in get_args(Attention):
                raise ValueError(f"--attention {self.attention}: choose one of {', '.join(get_args(Attention))}")
            if not spec.has_attention:
                raise ValueError(f"--attention applies to models that attend; {spec.name} has no attention")
            if self.attention == "sdpa" and spec.hf is not None and not spec.hf.sdpa:
                raise ValueError(f"--attention sdpa: transformers' {spec.hf.model_class} computes attention without"
                                 " torch's scaled_dot_product_attention; plan it with --attention eager")
            if self.attention == "flash" and spec.hf is not None and not spec.hf.flash:
                raise ValueError(f"--attention flash: transformers' {spec.hf.model_class} has no flash_attention_2"
                                 " implementation; plan it with --attention sdpa or eager")
            if self.attention == "flash" and self.precision == "fp32":
                raise ValueError("--attention flash with --precision fp32: flash-attn computes in fp16 or bf16 only")
        takers = min(_micro_batch_takers(self).values())  # the largest tensor-parallel groups: the fewest
        if self.global_batch is not None and self.global_batch % (takers * (self.micro_batch or 1)):
            micro = f" × --micro-batch {self.micro_batch}" if self.micro_batch else ""
            groups = f" tensor-parallel groups of {self.gpus // takers} GPUs" if takers < self.gpus else " GPUs"
            raise ValueError(f"--global-batch {self.global_batch:,} is not a multiple of {takers}{groups}{micro}:"
                             " every GPU (or tensor-parallel group) takes the same number of samples each step")

    @property
    def model_attention(self) -> Attention:
        """--attention, else SDPA where the model's transformers class has it, else eager."""
        if self.attention is not None:
            return self.attention
        hf = self.spec.hf
        return "eager" if hf is not None and not hf.sdpa and self.spec.has_attention else "sdpa"

    @property
    def trained_batch(self) -> int:
        """Samples per optimizer step every configuration trains: --global-batch, else one
        micro-batch per GPU (a tensor-parallel group trains its GPUs' micro-batches)."""
        return self.global_batch or self.gpus * (self.micro_batch or 1)

    @property
    def batch_text(self) -> str:
        """The batch a step trains, in the plan's header."""
        if self.global_batch is None:
            shared = (f" (global batch {self.trained_batch:,}: a tensor-parallel group takes its GPUs' samples)"
                      if tp_degrees(self) else "")
            return f"micro-batch {self.micro_batch or 1}{shared}"
        tokens = f", {self.global_batch * self.spec.tokens_per_sample / 1e6:.3g}M tokens" if self.spec.seq_len else ""
        if self.micro_batch is None:
            how = "each configuration at the largest micro-batch that fits, accumulating the rest"
        elif self.global_batch % (self.gpus * self.micro_batch):  # only tensor-parallel groups split it
            how = f"micro-batch {self.micro_batch} a tensor-parallel group, accumulating the rest"
        else:
            groups = " a GPU, more for a tensor-parallel group" if tp_degrees(self) else ""
            how = _micro_steps_text(self.micro_batch, self.global_batch // (self.gpus * self.micro_batch)) + groups
        return f"global batch {self.global_batch:,} a step ({how}{tokens})"

    @property
    def usable_host_bytes(self) -> float | None:
        """What offload may hold of a node's host memory; None where --host-mem was not given."""
        return None if self.host_mem_bytes is None else fit.HOST_USABLE_FRACTION * self.host_mem_bytes

    @property
    def spec(self) -> models.ModelSpec:
        spec = self.model if isinstance(self.model, models.ModelSpec) else models.get_preset(self.model)
        return dataclasses.replace(spec, seq_len=self.seq) if self.seq else spec


def tp_degrees(req: PlanRequest) -> tuple[int, ...]:
    """The tensor-parallel degrees tp_fsdp is planned at (PLANNED_TENSOR_PARALLEL): powers of
    two from 2 up to a node's GPUs, each leaving at least two data-parallel groups, that the
    model splits over (whole heads and MLP slices a GPU) at the request's precision and
    optimizer."""
    per_node = req.gpus // req.nodes

    def composes(degree: int) -> bool:
        try:  # as ``candidates`` builds its cells, at the request's attention
            strategy = StrategySpec(name=PLANNED_TENSOR_PARALLEL, precision=req.precision, optimizer=req.optimizer,
                                    tp_degree=degree, sequence_parallel=True, loss_parallel=True)
            cell = CellSpec(model=req.model, strategy=strategy, world_size=req.gpus, seq_len=req.seq,
                            attention=req.model_attention)
        except ValueError:
            return False
        return strategies.incompatibility(cell) is None

    return tuple(t for t in (2**k for k in range(1, per_node.bit_length()))
                 if req.gpus % t == 0 and req.gpus // t >= 2 and composes(t))


def candidates(req: PlanRequest, device_type: str = "cuda") -> list[CellSpec]:
    """Every planned strategy (tp_fsdp at each of ``tp_degrees``) × checkpointing × offload
    the strategy composes with, each training the request's batch (``trained_batch``): at
    --micro-batch, accumulating the rest, or without it at the largest micro-batch whose
    analytic peak fits (fit.sized) on a ``device_type`` device. A configuration the batch does
    not split over is left out."""
    usable = fit.USABLE_FRACTION * req.gpu_mem_bytes
    batch = req.trained_batch
    # One GPU runs the model whole: the single-process step with each checkpointing, and the
    # engines that offload at one rank (ZeRO-Offload's one-GPU case: DeepSpeed ZeRO-3, FSDP2);
    # an engine at one rank without offload is the single-process step with its overhead.
    names = (*PLANNED_STRATEGIES, *PLANNED_PIPELINES) if req.gpus >= 2 else ("single", *PLANNED_STRATEGIES)
    layouts: list[tuple[str, int | None]] = [(name, None) for name in names]
    layouts += [(PLANNED_TENSOR_PARALLEL, degree) for degree in tp_degrees(req)]
    micro = req.micro_batch or 1
    cells = []
    for name, degree in layouts:
        if name == "fsdp_hybrid" and req.nodes < 2:
            continue  # on one node HSDP is full sharding with a trivial replicate dimension
        pipelined = name in PLANNED_PIPELINES  # the batch divides by micro: PlanRequest checked it
        for ckpt in CHECKPOINTING_ORDER:
            for offload in OFFLOAD_ORDER:
                if req.gpus == 1 and name != "single" and offload == "none":
                    continue
                try:
                    strategy = StrategySpec(name=name, precision=req.precision, checkpointing=ckpt,
                                            offload=offload, optimizer=req.optimizer, tp_degree=degree,
                                            sequence_parallel=bool(degree), loss_parallel=bool(degree),
                                            pp_microbatches=batch // micro if pipelined else None)
                    cell = CellSpec(model=req.model, strategy=strategy, micro_batch=micro,
                                    world_size=req.gpus, seq_len=req.seq, attention=req.model_attention)
                except ValueError:
                    continue
                if strategies.incompatibility(cell) is not None:
                    continue
                if pipelined:  # the batch is its micro-batches already (PLANNED_PIPELINES)
                    cells.append(cell)
                elif req.micro_batch is None:
                    sized = fit.sized(cell, batch,
                                      lambda c: _analytic(c, req, device_type).get("peak_bytes", 0) <= usable)
                    cells += [sized] if sized else []
                elif batch % cell.global_batch == 0:
                    accumulation = batch // cell.global_batch
                    cells.append(dataclasses.replace(
                        cell, strategy=dataclasses.replace(strategy, accumulation=accumulation)))
    return cells


def _analytic(cell: CellSpec, req: PlanRequest, device_type: str) -> dict:
    return analytic.predict(cell, nodes=req.nodes, device_type=device_type)


def _preference(row: dict) -> tuple:
    s = row["cell"].strategy
    step = row["step_time"].get("step_time_s", float("inf"))
    return (step, OFFLOAD_ORDER.index(s.offload), CHECKPOINTING_ORDER.index(s.checkpointing),
            row["predicted"]["comm_volume_per_step"], row["predicted"]["peak_bytes"])


def _row(cell: CellSpec, req: PlanRequest, rates: rough_time.Rates, work: dict | None) -> dict:
    predicted = _analytic(cell, req, rates.device_type)
    step = rough_time.step_seconds(cell, rates, predicted, work, req.nodes)
    seconds = step.get("step_time_s")
    spec = cell.model_spec
    peak = flops.peak_flops(rates.gpu_name, flops.compute_precision(req.precision, "high"))
    model_flops = models.flops_per_sample(spec) * cell.global_batch / cell.world_size
    # What offload keeps in host memory, every rank of a node its own partition of it.
    host = sum(predicted["offloaded_bytes"].values()) * (req.gpus // req.nodes)
    host_fits = None if req.usable_host_bytes is None else host <= req.usable_host_bytes
    gpu_fits = predicted["peak_bytes"] <= fit.USABLE_FRACTION * req.gpu_mem_bytes
    return {"cell": cell, "predicted": predicted, "step_time": step,
            "tokens_per_s": cell.global_batch * spec.tokens_per_sample / seconds if seconds else None,
            "mfu": model_flops / seconds / peak if seconds and peak else None,
            "host_bytes_per_node": host, "host_fits": host_fits, "gpu_fits": gpu_fits,
            "fits": gpu_fits and host_fits is not False, "traced": None}


def plan(req: PlanRequest, trace: plan_work.Trace | None = None, named: str | None = None,
         rates: rough_time.Rates | None = None, work_trace: plan_work.Trace | None = None,
         measured: dict[str, float] | None = None) -> dict:
    """Every candidate's row, the recommendation, and the row of the ``named``
    configuration (a label as the table prints it), each step priced at ``rates`` (a run's
    calibration; rough_time's assumptions when None). With ``trace`` (cells -> {cell_id:
    traced}), the leading candidates and the named one are traced (module docstring); with
    ``work_trace`` (the same kind of function), each candidate's step work is traced at one
    and two blocks and extrapolated (predict/plan_work.py), for a run's rates; ``measured``
    (cell_id -> step seconds, the calibrating run's own cells) goes beside the prediction of
    each configuration that run measured."""
    rates = rates if rates is not None else rough_time.assumed(world_size=req.gpus, nodes=req.nodes,
                                                               inter_node_bytes_per_s=req.inter_node_bytes_per_s)
    # A CPU host's rates price what a CPU runs (no activation offload: its tensors are on the host);
    # GPU nodes are planned as having the packages a configuration needs (flash-attn: the header says so).
    unsupported = {c: strategies.unsupported_reason(c, rates.device_type, installed=False)
                   for c in candidates(req, rates.device_type)}
    if not unsupported:  # the batch splits over no layout this model has (PlanRequest checked the rest)
        raise ValueError(f"nothing to plan for {req.spec.name}: {_unsplit_text(req)}")
    cells = [c for c, why in unsupported.items() if why is None]
    if not cells:
        why = next(iter(unsupported.values()))
        raise ValueError(f"nothing to plan: no configuration runs on {rates.source}: {why}")
    # Ranked by the analytic peak: a configuration it does not describe is listed apart, and a
    # model none of whose configurations it describes (a Mamba, a factory's) cannot be planned.
    unplanned = {config_label(c): why for c in cells if (why := analytic.unavailable_reason(c, c.model_spec))}
    if cells and len(unplanned) == len(cells):
        raise ValueError(f"--model: plan ranks configurations by their analytic peak, and none of {req.spec.name}'s"
                         f" has one ({next(iter(unplanned.values()))}); its cells run all the same, each record"
                         " with its traced peak")
    if named in unplanned:
        raise ValueError(f"--config {named}: no analytic peak to plan it by ({unplanned[named]})")
    cells = [c for c in cells if config_label(c) not in unplanned]
    works = plan_work.stand_ins(cells, work_trace, rates.device_type, req.nodes) if work_trace else {}
    rows = [{**_row(cell, req, rates, works.get(cell.cell_id)),
             "measured_step_time_s": (measured or {}).get(cell.cell_id)} for cell in cells]
    by_label = {config_label(r["cell"]): r for r in rows}
    if named is not None and named not in by_label:
        raise ValueError(f"--config {named}: not a candidate here; choose one of {', '.join(sorted(by_label))}")
    if trace is not None:
        pending = [by_label[named]] if named is not None else []
        while True:
            leading = [r for r in sorted((r for r in rows if r["fits"]), key=_preference)[:TRACED_CANDIDATES]
                       if r["traced"] is None]
            batch = pending + [r for r in leading if r not in pending]
            if not batch:
                break
            results = trace(list(dict.fromkeys(peak_traced_as(r["cell"]) for r in batch)))
            for r in batch:
                r["traced"] = results[peak_traced_as(r["cell"]).cell_id]
                if ("fails" in r["traced"]
                        or r["traced"].get("peak_bytes", 0) > fit.USABLE_FRACTION * req.gpu_mem_bytes):
                    r["gpu_fits"] = r["fits"] = False
            pending = []
    fitting = sorted((r for r in rows if r["fits"]), key=_preference)
    return {"request": req, "rates": rates, "rows": sorted(rows, key=lambda r: r["predicted"]["peak_bytes"]),
            "unplanned": unplanned, "recommended": fitting[0] if fitting else None,
            "named": by_label.get(named) if named is not None else None}


def peak_traced_as(cell: CellSpec) -> CellSpec:
    """The cell whose trace gives ``cell``'s peak: the same, accumulating over two micro-steps
    at most. Every micro-step after the first holds what the ones before left (their
    gradients, or a partition of them) and the last also reduces them, so the second has
    every later one's peak, and each more costs the trace as long again (llama-tiny, 2 ranks,
    traced at 2 and at 4 micro-steps: the same peak to the byte under DDP, torch ZeRO-1,
    FSDP2's three modes and DeepSpeed ZeRO-1/2; DeepSpeed ZeRO-3 2 KB, 0.05 %, more at 4)."""
    if cell.strategy.accumulation <= 2:
        return cell
    return dataclasses.replace(cell, strategy=dataclasses.replace(cell.strategy, accumulation=2))


def recommendation_text(result: dict) -> str:
    req, best = result["request"], result["recommended"]
    usable = fit.USABLE_FRACTION * req.gpu_mem_bytes
    if best is None:
        host_bound = sorted((r for r in result["rows"] if r["gpu_fits"] and r["host_fits"] is False),
                            key=lambda r: r["host_bytes_per_node"])
        if host_bound and req.usable_host_bytes is not None:
            least = host_bound[0]
            return (f"Nothing fits: {len(host_bound)} configuration(s) fit {_gib(usable)} usable per GPU but offload"
                    f" more than the {_gib(req.usable_host_bytes)} usable of a node's host"
                    f" memory (the least {_gib(least['host_bytes_per_node'])}, {config_label(least['cell'])}), and the"
                    " others need more per GPU: add nodes (the offloaded states spread over them) or GPUs.")
        smallest = result["rows"][0] if result["rows"] else None
        need = (f"; the smallest predicted peak is {_gib(smallest['predicted']['peak_bytes'])}"
                f" ({config_label(smallest['cell'])})" if smallest else "")
        return (f"Nothing fits {_gib(usable)} usable of {_gib(req.gpu_mem_bytes)} per GPU{need}: add GPUs,"
                " shorten the sequence, or lower the micro-batch.")
    s = best["cell"].strategy
    peak = (best["traced"] or {}).get("peak_bytes", best["predicted"]["peak_bytes"])
    at = f" at {_cell_steps_text(best['cell'])}" if _batch_column(result) else ""
    text = (f"Recommended: {config_label(best['cell'])}{at}: fits with {_gib(usable - peak)} to spare"
            f" (peak {_gib(peak)}{' traced' if best['traced'] and 'peak_bytes' in best['traced'] else ''} of"
            f" {_gib(usable)} usable) and is fastest by the prediction: {_step_text(best)}.")
    runner_up = next((r for r in sorted((r for r in result["rows"] if r["fits"]), key=_preference)
                      if r["cell"].strategy.name != s.name), None)
    if runner_up is not None:
        text += f" {config_label(runner_up['cell'])} {_beside(runner_up, best)}."
    named = result.get("named")
    if named is not None and named is not best:
        verdict = ("fits" if named["fits"] else "fails (its trace raises what a real run raises)"
                   if "fails" in (named["traced"] or {}) else "does not fit")
        text += (f" Your {config_label(named['cell'])} {verdict}"
                 + (f" and would be {_slower(named, best):.2f}× slower." if named["fits"] else "."))
    offload = f" Offload costs host-device bandwidth every step{_host_text(best, req)}."
    return (text + ("" if s.offload == "none" else offload)
            + ("" if s.checkpointing == "none"
               else " Activation offload copies what the blocks save to host memory and back every micro-step."
               if s.checkpointing == "offload"
               else f" {s.checkpointing.capitalize()} checkpointing trades compute for memory."))


def _host_text(row: dict, req: PlanRequest) -> str:
    """What the row's offload holds in each node's host memory, against --host-mem's usable
    share where given."""
    held = f" and holds {_gib(row['host_bytes_per_node'])} in each node's host memory"
    if req.usable_host_bytes is None:
        return held + " (not checked: give --host-mem)"
    return held + f" of {_gib(req.usable_host_bytes)} usable"


def against_measured(result: dict) -> dict | None:
    """{"count", "median", "min", "max"} of the predicted step over the measured, over the
    configurations the calibrating run measured; None where it measured none of them."""
    ratios = sorted(r["step_time"]["step_time_s"] / r["measured_step_time_s"] for r in result["rows"]
                    if r["measured_step_time_s"] and "step_time_s" in r["step_time"])
    if not ratios:
        return None
    return {"count": len(ratios), "median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


def _micro_batch_takers(req: PlanRequest) -> dict[str, int]:
    """What takes a micro-batch of its own, per planned layout: each GPU under the
    data-parallel strategies, each tensor-parallel group under tp_fsdp at a degree."""
    return {"the data-parallel strategies": req.gpus, **{f"tp_fsdp/tp{t}": req.gpus // t for t in tp_degrees(req)}}


def _unsplit_text(req: PlanRequest) -> str:
    """The layouts the batch does not split over, left out of the plan (``candidates``)."""
    micro = req.micro_batch or 1
    takers = _micro_batch_takers(req)
    left_out = [f"{what} ({n:,} {'GPUs' if what.startswith('the') else 'groups'})"
                for what, n in takers.items() if req.trained_batch % (n * micro)]
    if not left_out:
        return ""
    return (f"Not planned: {', '.join(left_out)}: a batch of {req.trained_batch:,} does not split into"
            f" micro-batches of {micro} over them (a tensor-parallel group takes one between its GPUs).")


def _unchecked_text(spec: models.ModelSpec) -> str:
    if (what := analytic.unheld(spec)) is None:
        return ""
    return (f" The analytic predictor has not been held against a trace for {what}:"
            " --traced traces the leading configurations.")


def _attention_text(req: PlanRequest) -> str:
    spec = req.spec
    if not spec.has_attention:
        return ""
    if req.model_attention == "flash":
        return ", flash attention (flash-attn's kernels: the package installed on every node)"
    why = (f" (transformers' {spec.hf.model_class} has no SDPA attention)"
           if req.attention is None and spec.hf is not None and not spec.hf.sdpa else "")
    return f", {req.model_attention} attention{why}"


def _host_mem_text(req: PlanRequest) -> str:
    if req.host_mem_bytes is None:
        return "host memory not checked (--host-mem)"
    return f"{_gib(req.host_mem_bytes)} of host memory a node ({fit.HOST_USABLE_FRACTION:.0%} usable by offload)"


def _single_node_sweep_text(req: PlanRequest, rates: rough_time.Rates) -> str:
    """Where a plan over several nodes has no rates for what crosses them: said."""
    if req.nodes < 2 or "across_nodes" in rates.calibration:
        return ""
    return ("; collectives across nodes priced as within one, as the run swept one node"
            " (--inter-node-bw states your network)")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _step_text(row: dict) -> str:
    step = row["step_time"]
    if "step_time_s" not in step:
        return f"no step time ({step['unavailable']})"
    mfu = f", MFU {_percent(row['mfu'])}" if row["mfu"] is not None else ""
    return f"{step['step_time_s']:.3g} s a step, {row['tokens_per_s']:,.0f} tokens/s{mfu}"


def _percent(fraction: float) -> str:
    """Two significant digits: 31%, 5.6%, and an offloading step's 0.34% rather than 0%."""
    return f"{fraction * 100:.2g}%"


def _slower(row: dict, best: dict) -> float:
    return row["step_time"].get("step_time_s", float("inf")) / best["step_time"]["step_time_s"]


def _beside(runner_up: dict, best: dict) -> str:
    """How the runner-up compares: so many times slower, or, where the two steps print alike,
    a tie and which of ``_preference``'s later keys put the recommendation first."""
    if f"{_slower(runner_up, best):.2f}" != "1.00":
        return f"would be {_slower(runner_up, best):.2f}× slower"
    b, r = best["cell"].strategy, runner_up["cell"].strategy
    reasons = [why for differs, why in (
        (OFFLOAD_ORDER.index(b.offload) < OFFLOAD_ORDER.index(r.offload), "it offloads less"),
        (CHECKPOINTING_ORDER.index(b.checkpointing) < CHECKPOINTING_ORDER.index(r.checkpointing),
         "it recomputes less"),
        (best["predicted"]["comm_volume_per_step"] < runner_up["predicted"]["comm_volume_per_step"],
         "it moves fewer bytes a step"),
        (best["predicted"]["peak_bytes"] < runner_up["predicted"]["peak_bytes"], "its peak is lower"),
    ) if differs]
    return (f"is predicted as fast ({_step_text(runner_up)}); "
            + (f"the recommendation goes first as {reasons[0]}" if reasons
               else "the two tie on step time, traffic and peak: either will do"))


def config_label(cell: CellSpec) -> str:
    """How plan names a configuration (``--config``): ``fsdp_full/bf16/ckpt_full``,
    ``tp_fsdp/tp4/sp/lossp/bf16/ckpt_none`` (the plan options tagged as in a cell id)."""
    s = cell.strategy
    options = [tag for tag, on in (("sp", s.sequence_parallel), ("lossp", s.loss_parallel)) if on]
    parts = [s.name, *((f"tp{s.tp_degree}",) if s.tp_degree else ()), *options, s.precision,
             f"ckpt_{s.checkpointing}"]
    if s.offload != "none":
        parts.append(f"offload_{s.offload}")
    return "/".join(parts)


def _micro_steps_text(micro_batch: int, accumulation: int) -> str:
    """``micro-batch 4 × 8 accumulation steps``, or ``micro-batch 4, no accumulation``."""
    if accumulation == 1:
        return f"micro-batch {micro_batch}, no accumulation"
    return f"micro-batch {micro_batch} × {accumulation} accumulation steps"


def _cell_steps_text(cell: CellSpec) -> str:
    """A configuration's ``_micro_steps_text``, or a pipeline's ``micro-batch 1 × 16
    pipelined micro-batches``."""
    s = cell.strategy
    if s.pipelined:
        return f"micro-batch {cell.micro_batch} × {s.layout('pp_microbatches')} pipelined micro-batches"
    return _micro_steps_text(cell.micro_batch, s.accumulation)


def _batch_column(result: dict) -> bool:
    """Whether the configurations train their batch in different micro-steps (each sized to
    fit, or a tensor-parallel group sharing its GPUs' samples): then the table has a batch
    column and the recommendation names its micro-steps."""
    req = result["request"]
    return ((req.global_batch is not None and req.micro_batch is None)
            or len({_batch_text(r["cell"]) for r in result["rows"]}) > 1)


def _batch_text(cell: CellSpec) -> str:
    """``4×8``: a configuration's micro-batch and micro-steps (accumulation steps, or a
    pipeline's micro-batches)."""
    s = cell.strategy
    return f"{cell.micro_batch}×{s.layout('pp_microbatches') if s.pipelined else s.accumulation}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def as_json(result: dict) -> str:
    req = result["request"]
    return json.dumps({
        "request": {**dataclasses.asdict(req), "model": spec_json(req.model)},
        "rows": [{"config": config_label(r["cell"]), "cell": r["cell"].to_dict(), "fits": r["fits"],
                  "predicted": r["predicted"], "step_time": r["step_time"], "tokens_per_s": r["tokens_per_s"],
                  "mfu": r["mfu"], "gpu_fits": r["gpu_fits"], "host_bytes_per_node": r["host_bytes_per_node"],
                  "host_fits": r["host_fits"],
                  "traced": r["traced"], "measured_step_time_s": r["measured_step_time_s"]}
                 for r in result["rows"]],
        "unplanned": result["unplanned"],  # label -> why the analytic predictor has no peak for it
        "recommended": config_label(result["recommended"]["cell"]) if result["recommended"] else None,
        "named": config_label(result["named"]["cell"]) if result["named"] else None,  # --config's
        "recommendation": recommendation_text(result),
        "against_measured": against_measured(result),
        "rates": {"source": result["rates"].source, "device_type": result["rates"].device_type,
                  "gpu": result["rates"].gpu_name, "usable_fraction": fit.USABLE_FRACTION,
                  "host_usable_fraction": fit.HOST_USABLE_FRACTION},
    }, indent=2)


def spec_json(model: str | models.ModelSpec) -> str | dict:
    return model.to_dict() if isinstance(model, models.ModelSpec) else model


def as_table(result: dict, markdown: bool) -> str:
    req = result["request"]
    spec = req.spec
    head = (f"{spec.name}: {models.param_layout(spec).numel / 1e9:.2f}B parameters, seq {spec.tokens_per_sample},"
            f" {req.batch_text}, {req.gpus} GPUs on {req.nodes} node(s), {_gib(req.gpu_mem_bytes)} each"
            f" ({fit.USABLE_FRACTION:.0%} usable), {_host_mem_text(req)}, {req.precision}, {req.optimizer}"
            f"{_attention_text(req)}."
            " Memory: analytic predictor"
            f" (harness/predict/analytic.py), per GPU; step time: harness/predict/rough_time.py on"
            f" {result['rates'].source}{_single_node_sweep_text(req, result['rates'])}.{_unchecked_text(spec)}")
    beside = against_measured(result)
    sized = _batch_column(result)
    cols = ("config", "fits", *(("batch",) if sized else ()), "peak", "params", "grads", "optimizer", "buffers",
            "activations", "transient", "offloaded", "host/node", "comm/step", "step s", "tokens/s", "MFU", "traced",
            *(("measured s",) if beside else ()))
    lines = [head, ""]
    if markdown:
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    else:
        lines.append(f"{cols[0]:<52} {cols[1]:<4} " + " ".join(f"{c:>11}" for c in cols[2:]))
    for r in result["rows"]:
        p = r["predicted"]
        st = p["model_states_bytes"]
        values = [p["peak_bytes"], st["params"], st["grads"], st["optimizer"], st["buffers"],
                  p["activation_bytes"]["layers"] + p["activation_bytes"]["logits"],
                  sum(p["transient_bytes"].values()), sum(p["offloaded_bytes"].values()), r["host_bytes_per_node"],
                  p["comm_volume_per_step"]]
        fits = "yes" if r["fits"] else "host" if r["gpu_fits"] else "no"
        step = r["step_time"].get("step_time_s")
        traced = (r["traced"] or {}).get("peak_bytes")
        cells = [_gib(v).replace(" GiB", "") for v in values] + [
            "-" if step is None else f"{step:.3g}", "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
            "-" if r["mfu"] is None else _percent(r["mfu"]),
            "-" if traced is None else _gib(traced).replace(" GiB", ""),
            *((_seconds(r["measured_step_time_s"]),) if beside else ())]
        if sized:
            cells.insert(0, _batch_text(r["cell"]))
        if markdown:
            lines.append(f"| {config_label(r['cell'])} | {fits} | " + " | ".join(cells) + " |")
        else:
            lines.append(f"{config_label(r['cell']):<52} {fits:<4} " + " ".join(f"{c:>11}" for c in cells))
    lines += ["", "(GiB; " + ("batch: micro-batch × accumulation steps; " if sized else "")
              + "fits host: the GPU, not the host memory offload needs; offloaded: per GPU, host/node: all"
              " of a node's GPUs' offloaded states; comm/step: bytes each GPU moves per step, an all-reduce counted"
              " twice as in ZeRO §7;"
              " traced: the FakeTensorMode peak with CUDA's attention kernels, for the configurations --traced traced"
              + ("; measured s: the step the calibrating run measured" if beside else "") + ")",
              "", recommendation_text(result)]
    by_reason: dict[str, list[str]] = {}
    for label, why in result["unplanned"].items():
        by_reason.setdefault(why, []).append(label)
    if unsplit := _unsplit_text(req):
        lines.append(unsplit)
    for why, labels in by_reason.items():
        shown = ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")
        lines.append(f"Not ranked, with no analytic peak: {shown}: {why}.")
    if beside:
        lines.append(f"The calibrating run measured {beside['count']} of these configurations: the predicted step"
                     f" over the measured, median {beside['median']:.3f} ({beside['min']:.3f}-{beside['max']:.3f}).")
    for r in result["rows"]:
        if r["traced"] is not None and "fails" in r["traced"]:
            lines.append(f"Traced {config_label(r['cell'])}: fails, as a real run does: {r['traced']['fails']}")
        elif r["traced"] is not None and "peak_bytes" not in r["traced"]:
            lines.append(f"Traced {config_label(r['cell'])}: unavailable: {r['traced'].get('unavailable', '?')}")
    return "\n".join(lines)
