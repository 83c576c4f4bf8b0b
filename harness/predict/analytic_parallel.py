"""The analytic model of a cell that splits the model or the sequence rather than (only) the
batch, per rank: tensor parallelism (tp, tp_fsdp), torch's pipeline schedules, Megatron
(tp × pp × dp), context parallelism (cp) and DeepSpeed AutoEP's expert parallelism. Each
strategy's parts (model states, activations, transients, communication) come from the
formulas and, where the strategy wraps a data-parallel engine, from analytic_data_parallel.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from harness import models, strategies
from harness.config import CellSpec
from harness.models import ModelSpec
from harness.predict import pipeline_schedule
from harness.predict.analytic_data_parallel import (
    PRECISION_BYTES,
    activation_bytes,
    comm_bytes_per_step,
    loss_bytes,
    model_states_at_step,
    optimizer_state_bytes,
    recompute_bytes,
    tensor_parallel_degree,
    transient_bytes,
    vocabulary_slices,
)
from harness.predict.formulas import (
    PipelinePeak,
    context_parallel_kv_bytes,
    expert_parallel_all_to_all_bytes,
    expert_parallel_local_params,
    expert_parallel_most_received_rows,
    megatron_model_states,
    megatron_optimizer_comm_bytes,
    megatron_tp_all_reduce_bytes,
    pipeline_bubble_fraction,
    pipeline_p2p_bytes,
    pipeline_peak,
    tp_model_states,
)
from harness.strategies import pipeline  # its stage split; the schedules come from torch

if TYPE_CHECKING:  # a type only: importing it loads every model family and transformers
    from harness.models import ParamLayout

# The residual stream that crosses a pipeline boundary stays fp32 under torch autocast.
_BOUNDARY_BYTES = 4


def _embedding_numel(spec: ModelSpec) -> int:
    positions = spec.required("seq_len") * spec.hidden if spec.layout == "gpt2" else 0  # GPT-2's learned ones
    return spec.required("vocab_size") * spec.hidden + positions


def _low_precision_copies(cell: CellSpec, local_params: float) -> float:
    """torch autocast caches a 16-bit copy of every weight it casts for the forward."""
    return 2.0 * local_params if cell.strategy.precision != "fp32" else 0.0


def _rank_peak(rank: dict) -> float:
    """A rank's highest: where its schedule is played out (a pipeline's ranks), its
    schedule's highest ``moment`` or its states alone (the optimizer step), whichever is
    higher; else its states, activations and transients at once."""
    if "moment" in rank:
        return max(sum(rank["moment"].values()), sum(rank["states"].values()))
    return sum(rank["states"].values()) + rank["activations"] + sum(rank["transient"].values())


# --- tensor parallelism ---------------------------------------------------------------------------

def tp_sharded_numel(spec: ModelSpec) -> int | None:
    """Parameters of the blocks' column- and row-parallel linear layers (Megatron §3): the
    attention's Q, K, V (column, their biases split with them) and output projection (row,
    its bias replicated), the MLP's first linear(s) (column) and second (row). None for the
    families whose blocks are not a plain attention + MLP pair (mixture of experts: experts
    are split by expert parallelism, not this)."""
    h, f, d = spec.hidden, spec.ffn, spec.head_dim
    if spec.layout == "gpt2":
        per_block = (h * 3 * h + 3 * h) + h * h + (h * f + f) + f * h
    elif spec.layout == "llama":
        heads = spec.required("n_heads")
        per_block = h * (heads + 2 * spec.kv_heads) * d + heads * d * h + 3 * h * f
    else:
        return None
    return spec.n_layers * per_block


def _split_numel(spec: ModelSpec) -> int:
    """``tp_sharded_numel`` of a family whose split is modelled (analytic.unavailable_reason
    gives the others no prediction)."""
    sharded = tp_sharded_numel(spec)
    if sharded is None:
        raise ValueError(f"model {spec.name}: which of its parameters tensor parallelism splits is not modelled"
                         " (the gpt2 and llama layouts only)")
    return sharded


def tp_split_numel(cell: CellSpec) -> int:
    """Parameters a tensor-parallel group splits: the blocks' matmuls (``tp_sharded_numel``)
    and, with ``loss_parallel``, the vocabulary-parallel token table and untied head, as
    Megatron splits them (``megatron_split_numel``)."""
    spec = cell.model_spec
    return megatron_split_numel(spec) if cell.strategy.loss_parallel else _split_numel(spec)


def tp_local_numel(cell: CellSpec, layout: ParamLayout) -> float:
    """Parameters one rank of a tensor-parallel group holds before any data-parallel sharding:
    its slice of the split ones (``tp_split_numel``) and every replicated one."""
    return _local_of(cell, layout.numel, tp_split_numel(cell))


def tp_accumulated_numel(cell: CellSpec, layout: ParamLayout) -> float:
    """The gradient elements a tensor-parallel rank's micro-steps without gradient sync hold
    unsharded (EngineModel.accumulated_grads): its part of every one (``tp_local_numel``),
    but an untied vocabulary-parallel token table's whole, which the embedding's backward
    computes on every rank (llama-tiny under tp_fsdp at 4 ranks, 2 micro-steps: 65,536 B over
    its slice, measured; tp cuts it to the slice as it accumulates)."""
    spec = cell.model_spec
    table = 0 if spec.head_tied else spec.required("vocab_size") * spec.hidden
    return tp_local_numel(cell, layout) + table * (1 - 1 / vocabulary_slices(cell))


def _local_root_numel(cell: CellSpec, layout: ParamLayout) -> float:
    """A rank's part of the parameters outside the blocks: all of them, but its slice of the
    vocabulary-parallel ones."""
    return _local_of(cell, layout.root_numel, tp_split_numel(cell) - _split_numel(cell.model_spec))


def _local_of(cell: CellSpec, numel: float, split: float) -> float:
    return numel - split * (1 - 1 / tensor_parallel_degree(cell))


def _sharded_over_data_parallel(cell: CellSpec) -> bool:
    """tp_fsdp: FSDP2 shards each tensor-parallel part over the data-parallel groups, and casts
    the parameters to the compute dtype itself (tp computes under torch autocast)."""
    return "params" in strategies.get(cell.strategy.name).engine_model.sharded


def _tp_states(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict[str, float]:
    """tp: Megatron's split with fp32 parameters, gradients and AdamW moments (torch
    autocast keeps fp32 parameters: no master copy); tp_fsdp: the same, then sharded over
    the data-parallel dimension (FSDP2 holds ZeRO-3's layout at the optimizer step)."""
    sharded = tp_split_numel(cell)
    dp = cell.strategy.data_parallel_size(cell.world_size) if _sharded_over_data_parallel(cell) else 1
    states = tp_model_states(sharded, layout.numel - sharded, tensor_parallel_degree(cell), data_parallel=dp)
    step_counters = 4 * len(layout.shapes)  # one fp32 step per tensor, split or not
    return {"params": states.params, "grads": states.grads, "optimizer": states.optimizer + step_counters,
            "buffers": 0.0}


def _recomputed_all_reduces(cell: CellSpec) -> int:
    """Forward all-reduces a checkpointed block's recompute repeats: it stops at its last saved
    tensor, so one, the attention's (tests/test_tensor_parallel.py)."""
    return int(cell.strategy.checkpointing != "none")


def tp_activation_calls(cell: CellSpec, kind: str) -> list[tuple[float, int]]:
    """Tensor parallelism's ``kind`` calls a step, every micro-step's
    (``_tp_activation_collectives``): (bytes a call, calls)."""
    return [(nbytes, n * cell.strategy.accumulation) for nbytes, n in _tp_activation_collectives(cell).get(kind, [])]


def _tp_activation_collectives(cell: CellSpec) -> dict[str, list[tuple[float, int]]]:
    """Tensor parallelism's collectives of activations (and, under sequence parallelism, of
    the norms' gradients) in one micro-step, by kind: (bytes a call, calls). A call's bytes
    are the whole b·s·h tensor, as the record counts them (a gather's output, a scatter's
    input).

    The widths: tp computes under autocast, where the residual stream and the norms' outputs
    stay fp32 and the matmuls' outputs are 16-bit; a gradient is as wide as its tensor. tp_fsdp
    casts the parameters (FSDP's policy), so there everything is in the compute dtype.
    - Without sequence parallelism (Megatron's f and g, ``tp_all_reduce_bytes``): per block
      two all-reduces of the row-parallel outputs in forward and two of the regions' input
      gradients in backward (tests/test_tensor_parallel.py: gpt2-tiny bf16 98,304 B = 4 ×
      2-byte forward + 4 × 4-byte backward values of b·s·h); a checkpointed block's recompute
      stops at its last saved tensor and repeats one, the attention's.
    - With it (Korthikanti et al. 2022) each all-reduce is a reduce-scatter and an
      all-gather: forward, each region's input gathered and its output scattered; backward,
      the reverse; the recompute repeats the attention's pair and the MLP's gather. Besides:
      the first block's input gradient gathered (the stream is cut there), the head's input
      gathered, and each norm parameter's gradient all-reduced once (partial sums over the
      slices), fp32 under tp, in the compute dtype under tp_fsdp.
    - With loss_parallel: the embedding's output all-reduced (each rank embeds its slice of
      the vocabulary), three per-token fp32 statistics of the split logits all-reduced (their
      maximum, the sum of exponentials, the target's logit), and the head's input gradient
      reduced: scattered to the slices with sequence parallelism, else all-reduced.
    - Per-head query and key norms (Qwen3's): each weight's gradient all-reduced, partial sums
      over the ranks' heads."""
    s, spec = cell.strategy, cell.model_spec
    low = PRECISION_BYTES[s.precision]
    stream = low if _sharded_over_data_parallel(cell) else 4
    tokens = cell.micro_batch * spec.tokens_per_sample
    activation, layers = tokens * spec.hidden, spec.n_layers
    recomputed = _recomputed_all_reduces(cell)
    calls: dict[str, list[tuple[float, int]]] = {"all_reduce": [], "all_gather": [], "reduce_scatter": []}
    if s.sequence_parallel:
        calls["all_gather"] += [(stream * activation, (2 + 2 * recomputed) * layers + 2),
                                (low * activation, 2 * layers)]
        calls["reduce_scatter"] += [(low * activation, (2 + recomputed) * layers), (stream * activation, 2 * layers)]
        calls["all_reduce"] += [(stream * numel, 1) for numel in _sequence_parallel_norms(spec)]
    else:
        calls["all_reduce"] += [(low * activation, (2 + recomputed) * layers), (stream * activation, 2 * layers)]
    if models.param_layout(spec).qk_norms_per_head:  # their weights' gradients, summed over the ranks' heads
        calls["all_reduce"] += [(stream * spec.head_dim, 1)] * (2 * layers)
    if s.loss_parallel:
        calls["all_reduce"] += [(stream * activation, 1), (4 * tokens, 3)]
        calls["reduce_scatter" if s.sequence_parallel else "all_reduce"].append((stream * activation, 1))
    return calls


def _sequence_parallel_norms(spec: ModelSpec) -> list[int]:
    """The elements of each norm parameter sequence parallelism leaves replicated: every
    block's norms' and the final norm's (GPT-2's LayerNorms a weight and a bias each, LLaMA's
    RMSNorms a weight, OLMo's none)."""
    layout = models.param_layout(spec)
    return [*layout.block_norm_param_numels * spec.n_layers, *layout.root_norm_param_numels]


def _tp_comm(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict[str, float]:
    """Tensor parallelism's collectives of activations (``_tp_activation_collectives``) every
    micro-step; tp_fsdp adds FSDP's gathers (forward and backward, the root's once) and
    reduce-scatter of each rank's tensor-parallel part."""
    s = cell.strategy
    out = {kind: s.accumulation * sum(nbytes * n for nbytes, n in calls)
           for kind, calls in _tp_activation_collectives(cell).items() if calls}
    if _sharded_over_data_parallel(cell):
        low = PRECISION_BYTES[s.precision]
        local = tp_local_numel(cell, layout)
        # Every unit gathered in forward and again in backward, but a root that stays gathered
        # between the two (its parameters are replicated over the tensor-parallel group).
        kept = strategies.get(s.name).engine_model.gathers == "forward_and_backward_but_root"
        root = _local_root_numel(cell, layout) if kept else 0.0
        out["all_gather"] = out.get("all_gather", 0.0) + low * (2 * local - root) * s.accumulation
        out["reduce_scatter"] = out.get("reduce_scatter", 0.0) + 4 * local
    return out


def _tp_parts(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict:
    states = _tp_states(cell, spec, layout)
    transient = {"gathered": 0.0, "autocast_copies": _low_precision_copies(cell, states["params"] / 4),
                 "recompute": recompute_bytes(cell, spec), "loss": loss_bytes(cell, spec)}  # replicated logits
    if _sharded_over_data_parallel(cell):  # FSDP2 casts itself; it gathers as fsdp_full does
        t = tensor_parallel_degree(cell)
        block = layout.block_numel - _split_numel(spec) / spec.n_layers * (1 - 1 / t)
        transient["gathered"] = PRECISION_BYTES[cell.strategy.precision] * (_local_root_numel(cell, layout) + 2 * block)
        transient["autocast_copies"] = 0.0
    return {"states": states, "activations": activation_bytes(cell, spec), "transient": transient,
            "comm": _tp_comm(cell, spec, layout), "extra": {}}


# --- pipelines (torch's schedules) ----------------------------------------------------------------

def pipeline_stage_layers(layers: int, stages: int) -> list[int]:
    """Consecutive blocks per stage (GPipe, Huang et al. 2019), as evenly as they go, as
    harness/strategies/pipeline.py splits them (``stage_blocks``): the remainder goes to the
    middle stages first, then the first, then the last (the first also embeds, the last also
    runs the LM head), so the first or the last stage may hold no block; a middle one must."""
    counts = [len(blocks) for blocks in pipeline.stage_blocks(layers, stages)] if stages >= 1 else []
    if not counts or 0 in counts[1:-1]:
        raise ValueError(f"stages={stages}: {layers} layers leave a middle stage empty (or no stage at all)")
    return counts


def pipeline_stage_params(block: float, layers: int, stages: int, *, first: float, last: float) -> list[float]:
    """Parameters each pipeline stage holds: its blocks (``pipeline_stage_layers``), the
    embeddings (``first``) on the first stage, the final norm and LM head (``last``) on the
    last. Each stage's optimizer steps its own, so its model states follow from these."""
    params = [n * block for n in pipeline_stage_layers(layers, stages)]
    params[0] += first
    params[-1] += last
    return params


def pipeline_rank_peak(schedule: str, rank: int, ranks: int, microbatches: int,
                       bytes_per_microbatch: dict[int, float], *, grads: dict[int, float] | None = None,
                       loss_stage: int | None = None, loss: float = 0.0, head: float = 0.0, head_grads: float = 0.0,
                       recompute: dict[int, float] | None = None) -> PipelinePeak:
    """``rank``'s highest moment (formulas.pipeline_peak, which says what the keywords weigh)
    along its schedule's order (predict/pipeline_schedule.py, torch's orders), from each of its
    stages' bytes for one micro-batch (one stage a rank, two interleaved): GPipe holds every
    micro-batch (Huang et al. 2019) before its first backward; 1F1B p − rank of them (Narayanan
    et al. 2021 §2.2.1), again once its gradients exist; interleaved 1F1B as torch's schedule
    orders them (``pipeline_first_stage_layer_activations`` is Megatron's closed form for
    rank 0)."""
    order = pipeline_schedule.rank_order(schedule, rank, ranks, microbatches, len(bytes_per_microbatch))
    return pipeline_peak([(a.stage, a.direction == "forward") for a in order], bytes_per_microbatch, grads=grads,
                         loss_stage=loss_stage, loss=loss, head=head, head_grads=head_grads, recompute=recompute)


def _boundaries(stages: range, n_stages: int) -> int:
    """The stage boundaries ``stages`` sit on: one for the first and the last, two between."""
    return sum((i > 0) + (i < n_stages - 1) for i in stages)


def pipeline_rank_calls(cell: CellSpec, rank: int = 0) -> dict[str, list[list[float]]]:
    """``rank``'s sends in one step (and as many receives), as [bytes a call, calls]: each
    micro-batch's hidden states or their gradient over each boundary of its stages (the
    hand-overs ``pipeline_p2p_bytes`` sums), and the tied table's gradient exchanged once
    where the rank holds the first or the last stage. The step-time predictor prices an
    untraced pipeline's hand-overs with rank 0's (predict/step_time.py)."""
    s, p, spec = cell.strategy, cell.world_size, cell.model_spec
    n_stages = pipeline.n_stages(s.name, p)
    hand_overs = s.layout("pp_microbatches") * _boundaries(range(rank, n_stages, p), n_stages)
    one = pipeline_p2p_bytes(cell.micro_batch, spec.tokens_per_sample, spec.hidden, 1, neighbours=1,
                             value_bytes=_BOUNDARY_BYTES)
    calls = [[one, float(hand_overs)]]
    if spec.head_tied and rank in (0, p - 1):
        calls.append([4.0 * spec.required("vocab_size") * spec.hidden, 1.0])
    return {"send": calls, "recv": calls}


def _pipeline_ranks(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> list[dict]:
    """Each rank's model states (fp32, the cell's per-element optimizer: AdamW or SGD's
    momentum), activations at its peak and transfers.

    A rank holds v stages (stage i on rank i mod p: v = 1, or 2 for the interleaved
    schedule, harness/strategies/pipeline.py). The embeddings sit on the first stage, the
    final norm and a V×h LM head on the last (a tied head is a copy there: the last stage
    computes the logits); the last stage also keeps, for each micro-batch in flight, what
    its loss and head keep (the activations' ``logits``) and its output, the logits in the
    compute dtype, which torch's PipelineStage holds until that micro-batch's backward is
    over (llama-tiny's last stage, 4 micro-batches in flight: 131,072 B each in fp32,
    traced). The rank's highest moment is ``pipeline_rank_peak``'s (its ``moment``, in the
    measured categories): a backward of the last stage starting, beside the loss's
    gradients (``loss_bytes``), or a checkpointed block recomputed once the head's backward
    is done; each stage's gradients only from its first backward on. Every boundary carries
    each micro-batch's b·s·h hidden states forward and their gradient back
    (``pipeline_p2p_bytes``); torch's PipelineStage keeps one receive buffer per micro-batch
    for each (a non-first stage's inputs, a non-last stage's output gradients) from step to
    step: the ``buffers``, as many bytes as the rank receives. A tied table's two copies
    (first and last stage) send each other their gradients once a step."""
    s, p = cell.strategy, cell.world_size
    m, schedule = s.layout("pp_microbatches"), strategies.get(s.name).engine_model.pipeline_schedule
    if schedule is None:
        raise ValueError(f"strategy={s.name}: its engine model declares no pipeline_schedule")
    vocab = spec.required("vocab_size")
    n_stages = pipeline.n_stages(s.name, p)
    first = _embedding_numel(spec)
    tied = spec.head_tied
    last = layout.root_numel - first + (vocab * spec.hidden if tied else 0)
    params = pipeline_stage_params(layout.block_numel, spec.n_layers, n_stages, first=first, last=last)
    acts = activation_bytes(cell, spec)
    layers_of = pipeline_stage_layers(spec.n_layers, n_stages)
    per_microbatch = [layers * acts["per_layer"] for layers in layers_of]
    output = PRECISION_BYTES[s.precision] * cell.micro_batch * spec.tokens_per_sample * vocab
    per_microbatch[-1] += acts["logits"] + output
    recomputed = recompute_bytes(cell, spec)
    ranks = []
    for rank in range(p):
        mine = range(rank, n_stages, p)
        n_params = sum(params[i] for i in mine)
        received = pipeline_p2p_bytes(cell.micro_batch, spec.tokens_per_sample, spec.hidden, m,
                                      neighbours=_boundaries(mine, n_stages),
                                      value_bytes=_BOUNDARY_BYTES)
        swapped = 4.0 * vocab * spec.hidden if tied and rank in (0, p - 1) else 0.0
        peak = pipeline_rank_peak(schedule, rank, p, m, {i: per_microbatch[i] for i in mine},
                                  grads={i: 4.0 * params[i] for i in mine}, loss_stage=n_stages - 1,
                                  loss=loss_bytes(cell, spec), head=acts["logits"], head_grads=4.0 * last,
                                  recompute={i: recomputed for i in mine if layers_of[i]})
        autocast_copies = _low_precision_copies(cell, n_params)
        states = {"params": 4.0 * n_params, "grads": 4.0 * n_params,
                  # As one flat tensor's: its moments exact, its step counters (torch's AdamW
                  # keeps one a tensor) approximated by one.
                  "optimizer": optimizer_state_bytes(((round(n_params),),), s.optimizer), "buffers": received}
        ranks.append({
            "states": states,
            "activations": peak.activations,
            "transient": {"gathered": 0.0, "autocast_copies": autocast_copies, "recompute": recomputed,
                          "loss": peak.loss},
            "moment": {"params": states["params"], "grads": peak.grads, "optimizer": states["optimizer"],
                       "activations": peak.activations + peak.recompute + autocast_copies,
                       "other": received + peak.loss},
            "comm": {"send": received + swapped, "recv": received + swapped}})
    return ranks


def _busiest(ranks: list[dict]) -> dict:
    """The rank that sends the most a step (the first of equals): whose communication a
    pipeline's record counts (measure/summary.py)."""
    return max(ranks, key=lambda rank: sum(rank["comm"].values()))


def _pipeline_parts(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict:
    """The rank whose peak is highest, and the busiest's communication."""
    ranks = _pipeline_ranks(cell, spec, layout)
    peak = max(ranks, key=_rank_peak)
    s = cell.strategy
    virtual_stages = pipeline.n_stages(s.name, cell.world_size) // cell.world_size
    return {"states": peak["states"],
            # The last stage's logits are inside its held total.
            "activations": {"per_layer": activation_bytes(cell, spec)["per_layer"], "layers": peak["activations"],
                            "logits": 0.0},
            "transient": peak["transient"], "comm": _busiest(ranks)["comm"], "schedule_moment": peak["moment"],
            "extra": {"bubble_fraction": pipeline_bubble_fraction(cell.world_size, s.layout("pp_microbatches"),
                                                                  virtual_stages),
                      "per_rank_peak_bytes": [_rank_peak(r) for r in ranks]}}


# --- Megatron-core (GPTModel, its DDP and distributed optimizer) ----------------------------------

def megatron_split_numel(spec: ModelSpec) -> int:
    """Parameters Megatron's GPTModel splits over its tensor-parallel ranks: the blocks'
    column- and row-parallel linears (``tp_sharded_numel``) and, vocabulary-parallel, the
    token table (VocabParallelEmbedding) and an untied output layer (ColumnParallelLinear; a
    tied one reuses the table). Position embeddings, norms and row-parallel biases are
    replicated."""
    tables = 1 if spec.family == "gpt2" or spec.tie_embeddings else 2
    return _split_numel(spec) + tables * spec.required("vocab_size") * spec.hidden


def _megatron_stage_params(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> list[float]:
    """Parameters each pipeline stage's tensor-parallel rank holds under Megatron: its
    n_layers / pp blocks with their linears split over tp; the first stage the
    vocabulary-parallel table (and GPT-2's replicated positions); the last the final norm and
    the vocabulary-parallel output layer (a tied one is the table itself at pp = 1, a copy of
    it on the last stage otherwise)."""
    s, vocab_table = cell.strategy, spec.required("vocab_size") * spec.hidden
    tp, pp = s.layout("tp_degree"), s.layout("pp_degree")
    tied = spec.head_tied
    split_per_block = _split_numel(spec) / spec.n_layers
    block = layout.block_numel - split_per_block * (1 - 1 / tp)
    norm = layout.root_numel - _embedding_numel(spec) - (0 if tied else vocab_table)
    first = vocab_table / tp + _embedding_numel(spec) - vocab_table
    last = norm + (vocab_table / tp if not tied or pp > 1 else 0.0)
    return pipeline_stage_params(block, spec.n_layers, pp, first=first, last=last)


def _megatron_stages(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> list[dict]:
    """Each pipeline stage's model states, activations at its peak and traffic per step.

    With pp > 1 a step is Megatron's 1F1B (forward_backward_pipelining_without_interleaving)
    over pp_microbatches micro-batches: stage i holds min(pp − i, m) of them
    (``pipeline_rank_peak``), sends and receives each one's fp32 b·s·h hidden states
    (pipeline_dtype) and their gradients over its boundaries, and a tied table's first- and
    last-stage copies all-reduce their fp32 gradients once a step (finalize_model_grads)."""
    s = cell.strategy
    tp, pp = s.layout("tp_degree"), s.layout("pp_degree")
    forwards = (s.layout("pp_microbatches") if pp > 1 else 1) * s.accumulation
    layers = spec.n_layers // pp
    tied = spec.head_tied
    acts = activation_bytes(cell, spec)
    logits = acts["logits"] / tp  # the cross entropy keeps its vocabulary-parallel fp32 softmax
    b, seq, h = cell.micro_batch, spec.tokens_per_sample, spec.hidden
    stages = []
    for i, n_params in enumerate(_megatron_stage_params(cell, spec, layout)):
        first, last = i == 0, i == pp - 1
        states = megatron_model_states(n_params, s.data_parallel_size(cell.world_size))
        all_reduce = forwards * megatron_tp_all_reduce_bytes(
            b, seq, h, layers, tp, embeds=first, head=last,
            recomputed_per_block=2 if s.checkpointing == "full" else 0)
        if tied and pp > 1 and (first or last):
            all_reduce += 4.0 * spec.required("vocab_size") * h / tp
        comm = {"all_reduce": all_reduce, **megatron_optimizer_comm_bytes(n_params)}
        if pp > 1:
            p2p = pipeline_p2p_bytes(b, seq, h, forwards, neighbours=(i > 0) + (i < pp - 1))
            comm |= {"send": p2p, "recv": p2p}
        per_microbatch = layers * acts["per_layer"] + (logits if last else 0.0)
        stages.append({
            "states": {"params": states.params, "grads": states.grads, "optimizer": states.optimizer,
                       "buffers": 0.0},
            "activations": pipeline_rank_peak("1f1b", i, pp, forwards, {i: per_microbatch}).activations,
            "transient": {"gathered": 0.0, "autocast_copies": 0.0, "recompute": recompute_bytes(cell, spec)},
            "comm": comm})
    return stages


def _megatron_parts(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict:
    """megatron (fp32 only), the stage whose peak is highest: ``megatron_model_states``,
    Korthikanti's tensor-parallel activations (eager attention, as Megatron's local layers
    compute it) and ``megatron_tp_all_reduce_bytes`` per micro-batch,
    ``megatron_optimizer_comm_bytes`` once a step, and with pp > 1 the schedule's transfers.
    Not measured (megatron needs CUDA). Omitted: the buffers' padding (each parameter starts
    at a multiple of 64 elements, each bucket ends at one of lcm(dp, 128)), AdamW's step
    counters (host tensors on CUDA) and the scalar collectives (gradient norm, loss)."""
    stages = _megatron_stages(cell, spec, layout)
    peak = max(stages, key=_rank_peak)
    acts = activation_bytes(cell, spec)
    extra = {}
    s = cell.strategy
    if s.layout("pp_degree") > 1:
        extra = {"bubble_fraction": pipeline_bubble_fraction(s.layout("pp_degree"), s.layout("pp_microbatches")),
                 "per_stage_peak_bytes": [_rank_peak(st) for st in stages]}
    return {"states": peak["states"],
            "activations": {"per_layer": acts["per_layer"], "layers": peak["activations"], "logits": 0.0},
            "transient": peak["transient"], "comm": _busiest(stages)["comm"], "extra": extra}


# --- context parallelism --------------------------------------------------------------------------

def _cp_parts(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict:
    """cp wraps the replicated model in DDP: DDP's model states, gradient all-reduce and
    transients; the activations of the rank's s/W tokens (its sequence shard); ring
    attention's K/V traffic (``context_parallel_kv_bytes``) per micro-step, with K and V at
    kv_heads wide (transformers passes grouped K and V to SDPA when there is no mask, which
    the strategy arranges; assumed kept so by the CUDA kernels) and a fully checkpointed
    block recomputing its attention (the harness's selective policy saves SDPA's outputs).
    Omitted: the gathered K/V buffer and the ring's partial outputs, which live only within
    one attention call."""
    s, degree = cell.strategy, cell.world_size
    as_ddp = dataclasses.replace(cell, strategy=dataclasses.replace(s, name="ddp"))
    shard = dataclasses.replace(spec, seq_len=spec.required("seq_len") // degree)
    ring = context_parallel_kv_bytes(cell.micro_batch, spec.tokens_per_sample, spec.kv_heads * spec.head_dim,
                                     spec.n_layers, degree, value_bytes=PRECISION_BYTES[s.precision],
                                     recomputed_per_layer=int(s.checkpointing == "full"))
    comm = comm_bytes_per_step(as_ddp, layout) | {op: s.accumulation * nbytes for op, nbytes in ring.items()}
    return {"states": model_states_at_step(as_ddp, layout), "activations": activation_bytes(cell, shard),
            "transient": transient_bytes(as_ddp, layout, shard), "comm": comm, "extra": {}}


# --- expert parallelism ---------------------------------------------------------------------------

Shapes = list[tuple[int, ...]]


def _autoep_shapes(spec: ModelSpec, layout: ParamLayout, ep: int) -> tuple[Shapes, Shapes]:
    """(the non-expert tensors, this rank's expert tensors) as AutoEP holds them: in place of
    each MoE layer's stacked 3-D gate_up_proj and down_proj (the model's only 3-D weights,
    harness/models/moe.py) its GroupedExperts' w1, w3 (E/ep × ffn × h) and w2 (E/ep × h × ffn)
    (deepspeed/moe/ep_experts.py): the same values in three tensors, which counts for the
    optimizer's per-tensor state."""
    shared = [shape for shape in layout.shapes if len(shape) != 3]
    local, h, f = spec.required("n_experts") // ep, spec.hidden, spec.ffn
    experts: Shapes = [(local, f, h), (local, h, f), (local, f, h)] * spec.n_layers
    return shared, experts


def _expert_parallel_parts(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict:
    """deepspeed_autoep (fp32; harness/strategies/expert_parallel.py), every rank alike, its
    expert-parallel group the whole world:
    - model states: ``expert_parallel_local_params`` in fp32 with their AdamW moments and
      step counters (the client optimizer steps the rank's own tensors); ZeRO stage 0 keeps
      no gradient bucket or master copy (README "Predicted beside measured");
    - communication: one fp32 all-reduce of every local gradient per step (the non-expert
      ones over all ranks, the experts' over their expert-data-parallel group: one rank here,
      still issued and counted) and ``expert_parallel_all_to_all_bytes`` per micro-step for
      the balanced routing (the mean over ranks; the record holds rank 0's, whose routing may
      differ by a few rows); the worst case (``expert_parallel_most_received_rows``) is
      reported beside it as ``all_to_all_worst_case_bytes``;
    - activations: the mixture of experts' (``activation_bytes``), AutoEP's dispatch buffers
      left out."""
    s, ep = cell.strategy, cell.world_size
    n_experts, top_k = spec.required("n_experts"), spec.required("top_k")
    shared, experts = _autoep_shapes(spec, layout, ep)
    local = expert_parallel_local_params(shared=sum(math.prod(shape) for shape in shared),
                                         expert=3 * spec.hidden * spec.ffn, n_experts=n_experts,
                                         layers=spec.n_layers, ep=ep)
    states = {"params": 4.0 * local, "grads": 4.0 * local,
              "optimizer": optimizer_state_bytes(shared + experts, s.optimizer), "buffers": 0.0}
    tokens = cell.micro_batch * spec.tokens_per_sample

    def all_to_all(received_rows: float | None = None) -> float:
        return s.accumulation * expert_parallel_all_to_all_bytes(
            tokens, spec.hidden, top_k, n_experts, spec.n_layers, ep, received_rows=received_rows,
            recomputed_per_layer=int(s.checkpointing != "none"))

    worst = all_to_all(expert_parallel_most_received_rows(tokens, top_k, n_experts, ep))
    return {"states": states, "activations": activation_bytes(cell, spec),
            "transient": {"gathered": 0.0, "autocast_copies": 0.0, "recompute": recompute_bytes(cell, spec),
                          "loss": loss_bytes(cell, spec)},
            "comm": {"all_reduce": 4.0 * local, "all_to_all": all_to_all()},
            "extra": {"all_to_all_worst_case_bytes": worst}}


# --- one model-parallel cell ----------------------------------------------------------------------

def model_parallel_parts(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict:
    """States, activations, transients and communication per rank of a cell that splits the
    model or the sequence rather than (only) the batch."""
    parts = {"tensor_parallel": _tp_parts, "megatron": _megatron_parts, "context_parallel": _cp_parts,
             "expert_parallel": _expert_parallel_parts, "pipeline": _pipeline_parts}
    return parts[strategies.get(cell.strategy.name).engine_model.analytic](cell, spec, layout)
