"""A cell's step time, predicted from the work its step does and the rates the run measured:
the record's ``predicted.step_time_s`` and its parts (``predicted.step_time``).

The work (per rank, one optimizer step):
- traced (harness/measure/dispatched_work.py), where the cell was traced: every aten op rank
  0 dispatched, the FLOPs of its matmuls and attention kernels (recomputation included, as
  the checkpointed step really runs it), the bytes its other ops read and wrote, and every
  collective call with its size;
- a stand-in's, where the cell itself cannot be traced but a cell nearest to it can
  (traced.work_stand_in: DeepSpeed's optimizer offload, AutoEP): its dispatched work, with
  each collective kind the stand-in does not issue added as the cell's analytic bytes in one
  call;
- analytic otherwise (``analytic_work``): the PaLM FLOPs of the rank's samples (one forward
  more under full checkpointing), the activations' memory traffic (the recomputed ones' once
  more), the optimizer's (its own step's bytes per element as counted with the implementation
  torch picks on the device, dispatched_work.optimizer_step_work, over the elements the rank
  steps), and the analytic bytes per collective as one call each; no op count (what dispatch
  costs is then missing, which on the CPU's tiny presets is most of a step). A plan priced at
  a run's rates traces its configurations' first blocks instead (predict/plan_work.py).

The rates (harness/measure/compute_rate.py and the bandwidth sweep, both measured in the
run's own calibration launch; the record names which was used):
- compute = ops × (op_s + the engine's overhead) + each matmul size's FLOPs ÷ the matmul rate
  measured for that size + each attention kernel's and convolution's FLOPs ÷ the rate
  measured for its direction and FLOPs per head or per call + each top-k's elements ÷ the rate
  measured for its size + each optimizer library op's calls and elements at the costs measured
  for it (bitsandbytes' updates, beyond their bytes) + each op size's bytes ÷ the memory bandwidth measured for that
  working set × memory_factor at that size, all at the cell's precision; memory_factor is how
  much slower per byte a model step's elementwise ops ran than the STREAM add (compute_rate's
  docstring). The engine's overhead per op (``engine_overhead_per_op``, CPU runs): what the
  calibration's step of the cell's strategy (harness/calibration.py) took beyond its own
  work priced this way, over its ops (a pipeline's: the overhead at which its timeline,
  below, takes that step's time); that step is llama-tiny's, so a cell of that model,
  strategy, fp32 and micro-batch 2 is predicted from its own engine's step, and every other
  cell from its strategy's on another configuration. On CUDA the engine's host work runs
  ahead of the GPU's kernels and is not added. A single-process cell takes the rates rank 0
  measured alone, a distributed one those measured with every rank busy; on the CPU a cell
  with more ranks than the calibration had (and so more ranks than cores) gets its share of
  them.
- communication: each call at the time the sweep measured for its collective and size
  (log-log between measured sizes, the smallest size's latency below them, the largest's
  bandwidth above them; all-reduce's bus factor 2(n−1)/n and the others' (n−1)/n rescale a
  sweep of another world size). A send or a recv is priced as the sweep's send/recv between
  ranks of one node. Each call is priced for its own process group (``call_group``: HSDP's
  shard group and replicas, tp_fsdp's tensor- and data-parallel groups, else the world): a job
  over several nodes prices what crosses them at the sweep across nodes (a run's own, or
  plan's assumed fabric) and what stays in a node (HSDP's shard group, a tensor-parallel
  group) at the node's (``_job_call_seconds``). Collectives the sweep does not run (gather, scatter, reduce; and
  broadcast, all-to-all and send/recv in a run swept before they were added) are priced as
  an all-gather of the same bytes. Local SGD's traced step is an averaging step, whose
  collectives are sent every ``local_sgd_period``-th step and none between: a step's share,
  a period's time over its steps.
- overlap: on the CPU none — gloo's threads compute the reductions on the cores the ranks
  compute on, so a collective in flight takes its time from the step (a pipeline's
  hand-overs, which reduce nothing, are the exception: its timeline above). On CUDA the
  collectives run on their own stream: a data-parallel engine's gradient reductions overlap
  backward (two thirds of the compute; under accumulation the last micro-step's, unless the
  engine reduces every micro-step as DeepSpeed ZeRO-2 and ZeRO-3 do; never where they run on
  the compute stream, as DeepSpeed's do without ``overlap_comm``, its default for ZeRO-1/2), and the gather of its
  updated partitions (ZeRO-1/2) follows the step, exposed; an engine that shards the
  parameters gathers behind forward and backward, all but the first gather, which nothing
  precedes, its hidden reductions sharing that compute (``_exposed_on_cuda``). Tensor
  parallelism's all-reduces sit between a block's matmuls, each waited on by the next
  (torch's plans issue them synchronously): exposed whole; tp_fsdp's FSDP gathers and
  reduce-scatters overlap as FSDP2's do.
- a pipeline: its schedule played out (predict/pipeline_schedule.py), each rank's compute
  spread over its stages' micro-batches (the last rank's from its own trace, which holds the
  LM head and the loss; the middle ranks' from a middle rank's trace in proportion to their
  blocks; rank 0's own) and each hand-over between ranks a hop at the sweep's send/recv
  time for its size (between nodes, the sweep across them, where a run or plan spans several;
  an untraced pipeline's hand-overs are analytic_parallel.pipeline_rank_calls'). ``compute_s`` is the slowest rank's,
  ``bubble`` the timeline without hops over it (with equal stages the papers' 1 + (p − 1)/m
  for m micro-batches over p ranks, 1 + (p − 1)/(v·m) with v stages a rank: Huang et al.
  2019, Narayanan et al. 2021); the exposed communication is what the hops on its critical
  path add, and any other call whole.
- offload on CUDA: the offloaded parameters cross PCIe twice a step and gradients once, the
  blocks' saved activations under activation offload (checkpointing=offload) twice
  (``PCIE_BYTES_PER_S``, an assumption stated here), and an offloaded optimizer's step is
  memory traffic at host bandwidth (the rate the CPU calibration would measure; none on a
  GPU run, so ``HOST_MEMORY_BYTES_PER_S``).

Not modelled: Python between ops (the engines' hooks and bookkeeping) beyond what the
engine's overhead per op spreads over its ops, waiting on a slower rank, the allocator, and the
dispatcher's cost of ops the trace does not see.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable

from harness import models, strategies
from harness.calibration import engine_step_cell
from harness.config import CellSpec
from harness.features import optimizers
from harness.measure import compute_rate, dispatched_work
from harness.measure.comm import busbw_factor
from harness.predict import analytic_data_parallel, analytic_parallel, pipeline_schedule
from harness.strategies import pipeline
from harness.strategies.base import EngineModel

PCIE_BYTES_PER_S = 25e9  # PCIe 4.0 x16 host-device copies as measured by bandwidthTest, ~25 of 32 GB/s
HOST_MEMORY_BYTES_PER_S = 50e9  # a server socket's sustained stream bandwidth per GPU's share
# A collective kind as the record counts it -> the sweep's row that prices it.
_SWEPT_AS = {"send": "send_recv", "recv": "send_recv"}
_HOST_ADAM_BYTES_PER_ELEMENT = 28  # an offloaded step, fused (DeepSpeedCPUAdam): reads p, g, m, v, writes p, m, v


def predict(cell: CellSpec, analytic: dict, traced: dict, calibration: dict | None, device_type: str,
            nodes: int = 1) -> dict:
    """The record's ``predicted.step_time``: {"step_time_s", "compute_s", "comm_s",
    "exposed_comm_s", "bubble", "offload_s", "work", "rates"} or {"unavailable": reason};
    ``nodes``: the nodes the cell's ranks are spread over (``_job_call_seconds``)."""
    if not calibration or "error" in calibration or "skipped" in calibration:
        why = (calibration or {}).get("skipped") or (calibration or {}).get("error") or "no calibration in this run"
        return {"unavailable": f"no measured rates to price the step at: {why}"}
    engine = cell.strategy.name  # whose calibration step prices what the engine does around its ops
    if "work" in traced:
        work, source = traced["work"], "traced"
    elif "stand_in" in traced and "unavailable" not in analytic:
        work = _with_analytic_collectives(traced["stand_in"]["work"], analytic)
        source = f"traced stand-in {traced['stand_in']['cell_id']} ({traced['unavailable']})"
        engine = traced["stand_in"].get("strategy", engine)  # the work is the stand-in's step
    elif "unavailable" not in analytic:
        work = analytic_work(cell, analytic, device_type)
        source = f"analytic ({traced.get('unavailable', 'not traced')})"
    else:
        return {"unavailable": f"no work to price: not traced ({traced.get('unavailable')}) and no analytic"
                               f" prediction ({analytic['unavailable']})"}
    swept = calibration["rows"] or (nodes > 1 and (calibration.get("across_nodes") or {}).get("rows"))
    if cell.world_size > 1 and any(work["collectives"].values()) and not swept:
        return {"unavailable": f"no collective timings to price its communication at: {calibration.get('no_sweep')}"}
    rates, share = _rates(cell, calibration, device_type)
    overhead = (engine_overhead_per_op(engine, calibration)
                if device_type == "cpu" and cell.world_size > 1 else 0.0)
    compute = _compute_seconds(work, rates, cell.strategy.precision, overhead) / share
    sent_every = cell.strategy.local_sgd_period or 1
    priced = _comm_seconds_by_op(work, cell, calibration, nodes)
    comm_by_op = {kind: total / share / sent_every for kind, (total, _) in priced.items()}
    in_group_by_op = {kind: in_group / share / sent_every for kind, (_, in_group) in priced.items()}
    comm = sum(comm_by_op.values())
    if cell.strategy.pipelined:
        other_ranks = traced if source == "traced" else {}
        compute, bubble, exposed = _pipeline_step(cell, work, other_ranks, rates, overhead, share, calibration, nodes)
    else:
        bubble = 1.0
        exposed = (comm if device_type != "cuda"
                   else _exposed_on_cuda(cell, compute, work, comm_by_op, in_group_by_op, calibration, nodes))
    offload = _offload_seconds(cell, analytic) if device_type == "cuda" else 0.0
    step = compute * bubble + exposed + offload
    return {"step_time_s": step, "compute_s": compute, "comm_s": comm, "comm_s_by_op": comm_by_op,
            "exposed_comm_s": exposed, "bubble": bubble, "offload_s": offload, "work": source,
            "rates": "alone" if cell.world_size == 1 else "concurrent",
            **({"engine_overhead_per_op_s": overhead} if overhead else {}),
            **({"rank_share": share} if share != 1 else {})}


def engine_overhead_per_op(name: str, calibration: dict) -> float:
    """What an op of strategy ``name``'s engine costs beyond a plain step's op: its
    calibration step's time (harness/calibration.py) less that step's ops at the plain op
    cost, its matmuls and bytes and its collectives at the sweep's times, over its ops (never below
    0); for a pipeline, the overhead at which its timeline (``_pipeline_step``) takes the
    calibration step's time. 0 where the calibration timed no such step (a run from before
    engines were timed, or before pipelines were, a strategy the launch could not run)."""
    engine = calibration["compute_rates"].get("engines", {}).get(name, {})
    if "step_s" not in engine:
        return 0.0
    work, world_size = engine["work"], calibration["world_size"]
    rates = calibration["compute_rates"]["concurrent"]
    cell = engine_step_cell(name, world_size)
    if strategies.get(name).engine_model.analytic == "pipeline":
        def priced(overhead: float) -> float:
            compute, bubble, exposed = _pipeline_step(cell, work, engine, rates, overhead, 1.0, calibration)
            return compute * bubble + exposed

        return _solved(priced, engine["step_s"], most=engine["step_s"] / work["ops"])
    priced_step = (_compute_seconds(work, rates, "fp32", 0.0)
                   + _comm_seconds(work, cell, calibration))
    return max(0.0, (engine["step_s"] - priced_step) / work["ops"])


def _solved(increasing: Callable[[float], float], target: float, most: float) -> float:
    """The x in [0, most] where ``increasing(x)`` reaches ``target`` (0 if it starts above;
    bisection, to a millionth of ``most``)."""
    low, high = 0.0, most
    if increasing(low) >= target:
        return 0.0
    while high - low > most * 1e-6:
        middle = (low + high) / 2
        low, high = (middle, high) if increasing(middle) < target else (low, middle)
    return (low + high) / 2


def _compute_seconds(work: dict, rates: dict, precision: str, overhead_per_op: float) -> float:
    """ops × (op_s + the engine's overhead) + matmuls, attention, convolutions and top-k +
    bytes at memory_factor (module docstring)."""
    return (work["ops"] * (rates["op_s"][precision] + overhead_per_op)
            + compute_rate.kernel_seconds(work, rates, precision) + compute_rate.memory_seconds(work, rates))


def _comm_seconds_by_op(work: dict, cell: CellSpec, calibration: dict,
                        nodes: int = 1) -> dict[str, tuple[float, float]]:
    """Seconds of the step's calls by kind, each in its process group (``_calls_by_group``):
    (all of them, those in a tensor-parallel group)."""
    by_kind = {kind: [(calls * _job_call_seconds(kind, nbytes, cell, calibration, nodes, group), in_group)
                      for group, nbytes, calls, in_group in _calls_by_group(cell, kind, sizes, nodes)]
               for kind, sizes in work["collectives"].items()}
    return {kind: (sum(t for t, _ in calls), sum(t for t, in_group in calls if in_group))
            for kind, calls in by_kind.items()}


def _comm_seconds(work: dict, cell: CellSpec, calibration: dict, nodes: int = 1) -> float:
    return sum(total for total, _ in _comm_seconds_by_op(work, cell, calibration, nodes).values())


def _calls_by_group(cell: CellSpec, kind: str, sizes: list,
                    nodes: int) -> list[tuple[tuple[int, int], float, int, bool]]:
    """The step's ``kind`` calls ([bytes, calls] pairs) as (group, bytes, calls, whether the
    group is a tensor-parallel one), the group as ``call_group`` gives it. tp_fsdp calls both
    kinds of group for one kind under sequence parallelism (its regions' gathers and scatters
    in the tensor-parallel group, FSDP's over the data-parallel one): the calls of the sizes
    and counts analytic_parallel.tp_activation_calls names go to the first."""
    engine = strategies.get(cell.strategy.name).engine_model
    group = call_group(cell, kind, nodes)
    if engine.analytic != "tensor_parallel":
        return [(group, nbytes, calls, False) for nbytes, calls in sizes]
    tp_group = (analytic_data_parallel.tensor_parallel_degree(cell), 1)
    if group == tp_group:
        return [(group, nbytes, calls, True) for nbytes, calls in sizes]
    own: collections.Counter[int] = collections.Counter()
    for nbytes, calls in analytic_parallel.tp_activation_calls(cell, kind):
        own[round(nbytes)] += calls
    out = []
    for nbytes, calls in sizes:
        in_group = min(calls, own[round(nbytes)])
        own[round(nbytes)] -= in_group
        out += [(tp_group, nbytes, in_group, True)] if in_group else []
        out += [(group, nbytes, calls - in_group, False)] if calls > in_group else []
    return out


def _job_call_seconds(kind: str, nbytes: float, cell: CellSpec, calibration: dict, nodes: int,
                      group: tuple[int, int]) -> float:
    """One call of ``kind`` by its process ``group`` (ranks, stride), the cell's ranks spread over
    ``nodes`` nodes. A group within one node is priced at the run's own sweep; one that spans
    nodes at the sweep across them (``calibration["across_nodes"]``: a run on several nodes
    measures one, a plan assumes one, predict/rough_time.py), or, where there is none, at the
    one node's. The groups of a node's other ranks call theirs at the same time (HSDP's
    all-reduce over the replicas, one rank a node; tp_fsdp's data-parallel gathers, a
    tensor-parallel group's ranks each in their own), sharing the node's links: priced as one
    call of all their bytes."""
    ranks, stride = group
    per_node = cell.world_size // nodes
    if nodes < 2 or ranks * stride <= per_node:
        return _call_seconds(kind, nbytes, ranks, calibration["rows"], calibration["world_size"])
    across = calibration.get("across_nodes")
    shared = nbytes * min(stride, per_node)
    if not across:
        return _call_seconds(kind, shared, ranks, calibration["rows"], calibration["world_size"])
    return _call_seconds(kind, shared, ranks, across["rows"], across["world_size"], scope="inter_node")


def call_group(cell: CellSpec, kind: str, nodes: int = 1) -> tuple[int, int]:
    """(ranks, stride) of the process group a ``kind`` call of the cell runs in: consecutive
    ranks (stride 1) or every ``stride``-th. HSDP reduce-scatters and gathers in its shard
    group (a node) and all-reduces over the replicas; tp_fsdp all-reduces in its
    tensor-parallel group (the mesh's inner dimension) and gathers and reduce-scatters over
    the data-parallel one; every other engine over the world (Megatron's tensor- and
    data-parallel all-reduces among them: one kind, two groups)."""
    engine = strategies.get(cell.strategy.name).engine_model
    if engine.shard_group == "hsdp_shard":
        shard = analytic_data_parallel.shard_degree(cell, nodes)
        return (cell.world_size // shard, shard) if kind == "all_reduce" else (shard, 1)
    if engine.analytic == "tensor_parallel":
        tp = analytic_data_parallel.tensor_parallel_degree(cell)
        return (tp, 1) if kind == "all_reduce" or "params" not in engine.sharded else (cell.world_size // tp, tp)
    return cell.world_size, 1


def analytic_work(cell: CellSpec, analytic: dict, device_type: str) -> dict:
    """The work of the module docstring's analytic case, in dispatched_work's format."""
    s = cell.strategy
    samples = cell.micro_batch * s.accumulation * (s.layout("pp_microbatches") if s.pipelined else 1)
    recompute = 4 / 3 if s.checkpointing == "full" else 1.0
    flops = models.flops_per_sample(cell.model_spec) * samples * recompute / _model_split(cell)
    acts = analytic["activation_bytes"]
    # Every activation is written in forward and read twice in backward, the recomputed ones
    # written once more: checkpointing keeps fewer of them, it does not compute fewer.
    recomputed = cell.model_spec.n_layers * analytic.get("transient_bytes", {}).get("recompute", 0.0)
    activation_traffic = 3 * (acts["layers"] + recomputed + acts["logits"]) + recomputed
    optimizer_traffic = optimizer_elements(cell, analytic) * _optimizer_bytes_per_element(s.optimizer, device_type)
    # A pipeline's work is rank 0's (``_pipeline_step``): its hand-overs, one micro-batch's each.
    pipelined = strategies.get(s.name).engine_model.analytic == "pipeline"
    # Each stream at the working set of all of it: a first-order figure for want of op sizes.
    return {"ops": 0, "matmul_flops": flops,
            "memory_bytes": [[b, b] for b in sorted((optimizer_traffic, activation_traffic)) if b],
            "collectives": (analytic_parallel.pipeline_rank_calls(cell) if pipelined else
                            {kind: _analytic_collectives(cell, kind, nbytes)
                             for kind, nbytes in analytic["comm_bytes_by_op"].items() if nbytes})}


def _analytic_collectives(cell: CellSpec, kind: str, nbytes: float) -> list[list[float]]:
    """A step's ``kind`` bytes as [bytes a call, calls]: tensor parallelism's collectives of
    activations at their own sizes (analytic_parallel.tp_activation_calls), the rest spread
    over the engine's calls (``_engine_calls``)."""
    tensor_parallel = strategies.get(cell.strategy.name).engine_model.analytic == "tensor_parallel"
    own = analytic_parallel.tp_activation_calls(cell, kind) if tensor_parallel else []
    rest = nbytes - sum(size * calls for size, calls in own)
    engine_calls = _engine_calls(cell, kind)
    return [[size, calls] for size, calls in own if calls] + ([[rest / engine_calls, engine_calls]] if rest > 0 else [])


def _engine_calls(cell: CellSpec, kind: str) -> int:
    """The calls a step's ``kind`` bytes (but tensor parallelism's own) are spread over: one,
    but where the engine shards the parameters, one a unit (each block and the root) and
    pass: its gathers once or twice each micro-step, its reductions each micro-step or once
    (so that the first gather, which nothing hides on CUDA, is one unit's, and each call's
    latency is counted)."""
    engine = strategies.get(cell.strategy.name).engine_model
    s = cell.strategy
    if engine.analytic not in ("data_parallel", "tensor_parallel") or "params" not in engine.sharded:
        return 1
    units = cell.model_spec.n_layers + 1
    if kind == "all_gather":
        per_micro_step = {"forward": units, "forward_and_backward": 2 * units,
                          "forward_and_backward_but_root": 2 * units - 1}[engine.gathers]
        return per_micro_step * s.accumulation
    return units * (s.accumulation if engine.grad_partition_in_backward else 1)


def _optimizer_bytes_per_element(name: str, device_type: str) -> float:
    """What the optimizer's step reads and writes per parameter element: its step counted
    (dispatched_work.optimizer_step_work); for a CUDA kernel the CPU cannot step (DeepSpeed's
    FusedLamb), one fused pass: the parameter, its gradient and its state read once, the
    parameter and the state written once."""
    if name in optimizers.CUDA_KERNEL_ONLY:
        state = analytic_data_parallel.optimizer_state_bytes(((1,),), name)
        return 3 * 4 + 2 * state
    return dispatched_work.optimizer_step_work(name, device_type)["bytes_per_element"]


def optimizer_elements(cell: CellSpec, analytic: dict) -> float:
    """The parameter elements the rank's optimizer steps on the device: its shard of the
    model's where the engine shards the optimizer, its stage's or tensor slice's where the
    model is split; none where the optimizer is offloaded (``_offload_seconds`` prices it)."""
    if (analytic.get("offloaded_bytes") or {}).get("optimizer"):
        return 0.0
    numel = models.param_layout(cell.model_spec).numel
    engine = strategies.get(cell.strategy.name).engine_model
    if engine.analytic == "context_parallel":
        return numel  # every rank holds the whole model and splits the sequence
    if engine.analytic != "data_parallel":
        return numel / _model_split(cell)
    return numel / analytic_data_parallel.shard_degree(cell) if "optimizer" in engine.sharded else numel


def _with_analytic_collectives(work: dict, analytic: dict) -> dict:
    missing = {kind: [[nbytes, 1]] for kind, nbytes in analytic["comm_bytes_by_op"].items()
               if nbytes and kind not in work["collectives"]}
    return {**work, "collectives": {**work["collectives"], **missing}}


def _model_split(cell: CellSpec) -> int:
    """How many ranks share one sample's FLOPs and the model's parameters: a pipeline's ranks
    (an interleaved one's two stages a rank), or the tensor- or context-parallel degree."""
    kind = strategies.get(cell.strategy.name).engine_model.analytic
    if kind == "pipeline":
        return cell.world_size
    if kind in ("tensor_parallel", "context_parallel"):
        return cell.world_size // max(1, cell.strategy.data_parallel_size(cell.world_size))
    if kind == "megatron":
        return cell.strategy.layout("tp_degree") * cell.strategy.layout("pp_degree")
    return 1


def _rates(cell: CellSpec, calibration: dict, device_type: str) -> tuple[dict, float]:
    """The measured rates that apply, and the share of them each rank gets."""
    rates = calibration["compute_rates"]
    scope = "alone" if cell.world_size == 1 else "concurrent"
    measured_ranks = rates["world_size"]
    share = 1.0 if device_type == "cuda" or cell.world_size <= measured_ranks else measured_ranks / cell.world_size
    return rates[scope], share


def _call_seconds(kind: str, nbytes: float, world_size: int, rows: list[dict], swept_world_size: int,
                  scope: str = "intra_node") -> float:
    """One call's time by the sweep (module docstring); a send or recv between the ranks of
    one node, or with ``scope="inter_node"`` between nodes (the sweep's rows of that scope,
    and any that name none)."""
    if world_size < 2:
        return 0.0
    swept = _SWEPT_AS.get(kind, kind)
    if not any(r["op"] == swept for r in rows):
        swept = "all_gather"
    points = sorted((r["bytes"], r["time_s"]) for r in rows if r["op"] == swept and r.get("scope", scope) == scope)
    if not points:
        raise ValueError(f"the bandwidth sweep has no {swept} rows")
    sizes = [b for b, _ in points]
    if kind == "barrier" or nbytes <= sizes[0]:
        seconds = points[0][1]
    elif nbytes >= sizes[-1]:
        seconds = points[-1][1] * nbytes / sizes[-1]
    else:
        i = bisect.bisect_left(sizes, nbytes)
        (b0, t0), (b1, t1) = points[i - 1], points[i]
        weight = math.log(nbytes / b0) / math.log(b1 / b0)
        seconds = math.exp(math.log(t0) + weight * (math.log(t1) - math.log(t0)))
    return seconds * busbw_factor(swept, world_size) / busbw_factor(swept, swept_world_size)


def _exposed_on_cuda(cell: CellSpec, compute: float, work: dict, comm_by_op: dict[str, float],
                     in_group_by_op: dict[str, float], calibration: dict, nodes: int) -> float:
    """What of the step's communication no compute hides (module docstring, "overlap"):
    gradient reductions behind backward (two thirds of the compute), under accumulation the
    last micro-step's only unless the engine reduces every micro-step (DeepSpeed ZeRO-2 and
    ZeRO-3), and none where they run on the compute stream (DeepSpeed without overlap_comm:
    EngineModel.overlap_comm_default); a parameter-sharding engine's gathers behind all of it but the first unit's,
    sharing it with the hidden reductions; anything else (ZeRO-1/2's gather of the updated
    partitions, after the step; tensor parallelism's collectives, those of ``in_group_by_op``,
    between a block's matmuls; tp_fsdp's FSDP part overlapping as above) exposed."""
    engine = strategies.get(cell.strategy.name).engine_model
    if engine.analytic == "tensor_parallel" and "params" in engine.sharded:  # tp_fsdp: FSDP2 over the groups
        sharded_by_op = {kind: seconds - in_group_by_op.get(kind, 0.0) for kind, seconds in comm_by_op.items()}
        fsdp_calls = {kind: [[nbytes, calls] for _, nbytes, calls, in_group in _calls_by_group(cell, kind, sizes, nodes)
                             if not in_group] for kind, sizes in work["collectives"].items()}
        fsdp_work = {**work, "collectives": fsdp_calls}
        return sum(in_group_by_op.values()) + _exposed_sharded(cell, engine, compute, fsdp_work, sharded_by_op,
                                                               calibration, nodes)
    if engine.analytic != "data_parallel":
        return sum(comm_by_op.values())
    return _exposed_sharded(cell, engine, compute, work, comm_by_op, calibration, nodes)


def _exposed_sharded(cell: CellSpec, engine: EngineModel, compute: float, work: dict, comm_by_op: dict[str, float],
                     calibration: dict, nodes: int) -> float:
    """``_exposed_on_cuda`` of a data-parallel (or FSDP-over-tensor-parallel) engine's calls."""
    comm = sum(comm_by_op.values())
    reductions = comm_by_op.get("all_reduce", 0.0) + comm_by_op.get("reduce_scatter", 0.0)
    overlap_comm = cell.strategy.overlap_comm
    beside_backward = engine.overlap_comm_default is None or (
        overlap_comm if overlap_comm is not None else engine.overlap_comm_default)
    reducing_share = (0.0 if not beside_backward else 1.0 if engine.grad_partition_in_backward
                      else 1 / cell.strategy.accumulation)
    exposed_reductions = max(0.0, reductions - compute * 2 / 3 * reducing_share)
    if "params" not in engine.sharded:
        return (comm - reductions) + exposed_reductions
    first_gather = min((nbytes for nbytes, _ in work["collectives"].get("all_gather", [])), default=0)
    unhidden = (_job_call_seconds("all_gather", first_gather, cell, calibration, nodes,
                                  call_group(cell, "all_gather", nodes)) if first_gather else 0.0)
    hidden = comm - exposed_reductions - unhidden  # the gathers after the first, and the reductions in their window
    return unhidden + exposed_reductions + max(0.0, hidden - compute)


def _pipeline_step(cell: CellSpec, work: dict, other_ranks: dict, rates: dict, overhead: float, share: float,
                   calibration: dict, nodes: int = 1) -> tuple[float, float, float]:
    """(compute, bubble, exposed communication) of a pipeline, from its schedule played out
    (predict/pipeline_schedule.py): each rank's compute (``_pipeline_rank_seconds``, from
    rank 0's ``work`` and the ``other_ranks``' a trace or the calibration holds) spread evenly
    over its stages' micro-batches, a backward twice a forward (three times under full
    checkpointing, which recomputes it); compute is the slowest rank's and the bubble the
    timeline without hand-overs over it. The
    hand-overs are rank 0's send and recv calls of the size it sends most often (a
    micro-batch's hidden states or their gradient), each a hop at the sweep's send/recv time
    for that size (``_hop_seconds``: across nodes where the ranks are on different ``nodes``);
    only those on the critical path are exposed. Every other call (the tied embeddings'
    gradient exchange after the schedule) is exposed whole."""
    s = cell.strategy
    schedule = strategies.get(s.name).engine_model.pipeline_schedule
    if schedule is None:
        raise ValueError(f"strategy={s.name}: its engine model declares no pipeline_schedule")
    microbatches = s.layout("pp_microbatches")
    virtual = pipeline.n_stages(s.name, cell.world_size) // cell.world_size
    compute_by_rank = _pipeline_rank_seconds(
        cell, work, other_ranks, lambda w: _compute_seconds(w, rates, s.precision, overhead) / share)
    sends = work["collectives"].get("send", [])
    hop_bytes = max(sends, key=lambda size_calls: size_calls[1])[0] if sends else 0
    hop = _hop_seconds(hop_bytes, cell, calibration, nodes, share)
    # Every call but the hand-overs (the tied table's exchange, rank 0 with the last, across
    # nodes where there are several), priced in full on the job's nodes.
    others = {kind: [[nbytes, calls] for nbytes, calls in sizes if kind not in ("send", "recv") or nbytes != hop_bytes]
              for kind, sizes in work["collectives"].items()}
    other_comm = _comm_seconds({**work, "collectives": others}, cell, calibration, nodes) / share
    forward_share = 1 / 4 if s.checkpointing == "full" else 1 / 3
    action_s = [(per_action * forward_share, per_action * (1 - forward_share))
                for compute in compute_by_rank for per_action in [compute / (microbatches * virtual)]]
    idle = pipeline_schedule.step_seconds(schedule, microbatches, virtual, action_s, 0.0)
    timed = pipeline_schedule.step_seconds(schedule, microbatches, virtual, action_s, hop)
    slowest = max(compute_by_rank)
    return slowest, (idle / slowest if slowest else 1.0), timed - idle + other_comm


def _hop_seconds(nbytes: float, cell: CellSpec, calibration: dict, nodes: int,
                 share: float) -> Callable[[int, int], float]:
    """A pipeline hand-over of ``nbytes`` from one rank to another: the sweep's send/recv
    within a node, or, where the two ranks are on different ones of ``nodes`` (consecutive
    ranks a node), across them (``calibration["across_nodes"]``'s sweep, a run's or plan's
    assumed fabric; the node's own where there is none)."""
    if not nbytes:
        return lambda sender, receiver: 0.0
    p = cell.world_size
    within = _call_seconds("send", nbytes, p, calibration["rows"], calibration["world_size"]) / share
    across = calibration.get("across_nodes")
    if nodes < 2 or not across:
        return lambda sender, receiver: within
    between = _call_seconds("send", nbytes, p, across["rows"], across["world_size"], scope="inter_node") / share
    per_node = p // nodes
    return lambda sender, receiver: between if sender // per_node != receiver // per_node else within


def _pipeline_rank_seconds(cell: CellSpec, work: dict, other_ranks: dict,
                           price: Callable[[dict], float]) -> list[float]:
    """Each pipeline rank's compute seconds by ``price``: rank 0's from its ``work``, the
    last rank's from its own ("last_rank_work": the LM head and the loss are its), each
    middle rank's from the middle rank traced ("middle_rank_work": {"rank", "work"}) in
    proportion to the blocks each holds (pipeline.rank_blocks; the embedding and the head
    are the first's and the last's), and where a rank's work is missing (a calibration
    from before middle ranks were kept, a plan's analytic work) rank 0's."""
    p = cell.world_size
    first = price(work)
    last = price(other_ranks["last_rank_work"]) if "last_rank_work" in other_ranks else first
    middle = other_ranks.get("middle_rank_work")
    if middle is None:
        return [first] * (p - 1) + [last]
    blocks = pipeline.rank_blocks(cell.strategy.name, cell.model_spec.n_layers, p)
    per_block = price(middle["work"]) / blocks[middle["rank"]]
    return [first, *(per_block * blocks[rank] for rank in range(1, p - 1)), last]


def _offload_seconds(cell: CellSpec, analytic: dict) -> float:
    offloaded = analytic.get("offloaded_bytes") or {}
    params, optimizer = offloaded.get("params", 0.0), offloaded.get("optimizer", 0.0)
    grads = offloaded.get("grads", 0.0)
    # Activation offload copies what the blocks save to the host in forward and back in
    # backward, every micro-step.
    activations = offloaded.get("activations", 0.0) * cell.strategy.accumulation
    host_step = optimizer / 8 * _HOST_ADAM_BYTES_PER_ELEMENT / HOST_MEMORY_BYTES_PER_S if optimizer else 0.0
    return (2 * params + grads + 2 * activations) / PCIE_BYTES_PER_S + host_step

