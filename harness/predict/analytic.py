"""Analytic predictions from the papers' formulas (../shared/reference/formulas.md).

Two layers:

- The formulas as published, on plain numbers: ``zero_model_states`` and
  ``zero_comm_elements`` (ZeRO), ``activation_bytes_per_layer`` (Korthikanti et al.),
  ``powersgd_elements`` (Vogels et al.), ``optimizer_state_bytes`` (AdamW, 8-bit block-wise
  Adam, Adafactor), ``model_flops_per_step`` (Korthikanti App. A), tensor parallelism
  (``tp_model_states``, ``tp_all_reduce_bytes``: Shoeybi et al.), pipelines
  (``pipeline_bubble_fraction``, ``pipeline_*``: Huang et al., Narayanan et al.), Megatron's
  vocabulary-parallel layers and distributed optimizer (``megatron_*``), ring attention
  (``context_parallel_kv_bytes``) and expert parallelism (``expert_parallel_*``: GShard,
  Lepikhin et al.; DeepSpeed AutoEP's all-to-alls). The claims suite and the unit tests
  check these against the papers' own tables or hand-computed cases.
- ``predict(cell)``: the same formulas applied to one benchmark cell, with what the cell's
  engine does on top of the paper (which tensors it keeps in which precision, DDP's gradient
  bucket, how many times FSDP gathers the root unit, the order torch's pipeline schedule
  runs its micro-batches in, the receive buffers its stages keep), per rank, in the
  harness's own categories and byte conventions, so each number can be put beside the
  measured one.

What is checked against measurement (``python -m harness accuracy``: model states and
communication within ±10 %): the data-parallel and sharded strategies, tp / tp_fsdp, the
three pipeline schedules and deepspeed_autoep on 2 gloo ranks. deepspeed_autoep's token
all-to-alls depend on the routing: predicted for balanced routing, which is the mean over
the ranks exactly (rank 0's, the recorded one, was within 0.2 % on moe-tiny); the worst case
is beside it (``all_to_all_worst_case_bytes``). megatron and cp need CUDA: their predictions
are the formulas applied to the library's code as read (megatron-core 0.16.1, torch 2.13),
checked on hand-computed cases only (tests/test_predict_analytic.py) until a GPU run measures them.

Ψ = parameter count, N_d = data-parallel (sharding) degree, K = optimizer bytes per parameter.
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass

from harness import models
from harness.config import CellSpec
from harness.distributed import DistEnv, hsdp_shape
from harness.features.optimizers import BITSANDBYTES
from harness.models import ModelSpec, ParamLayout
from harness.strategies import deepspeed_zero  # its bucket sizing; DeepSpeed itself is imported on use
from harness.strategies import pipeline  # its stage split; the schedules come from torch

# zero_model_states defaults to mixed-precision Adam (ZeRO §3.1): fp16 parameters and
# gradients, K = 12 bytes of optimizer state per parameter (fp32 master weights, momentum,
# variance). Pure fp32 Adam: 4 + 4 + 8 bytes (two fp32 moments, no master copy) — also 16 per parameter.
FP32_ADAM = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    """Bytes per rank of each kind of model state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def zero_model_states(n_params: float, world_size: int, stage: int, *, param_bytes: float = 2,
                      grad_bytes: float = 2, optimizer_bytes: float = 12) -> ModelStates:
    """Model-state bytes per rank under ZeRO stage 0 (plain data parallelism) to 3.

    Rajbhandari et al. 2020, §5 and Table 1: P_os (stage 1) shards the optimizer state,
    P_os+g (stage 2) also the gradients, P_os+g+p (stage 3) also the parameters:
    baseline (2 + 2 + K)Ψ; P_os 2Ψ + 2Ψ + KΨ/N_d; P_os+g 2Ψ + (2 + K)Ψ/N_d;
    P_os+g+p (2 + 2 + K)Ψ/N_d (with the mixed-precision byte counts as defaults).
    """
    _check_stage(stage)
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be at least 1")
    shard = 1 / world_size
    return ModelStates(
        params=n_params * param_bytes * (shard if stage >= 3 else 1),
        grads=n_params * grad_bytes * (shard if stage >= 2 else 1),
        optimizer=n_params * optimizer_bytes * (shard if stage >= 1 else 1),
    )


def zero_comm_elements(n_params: float, stage: int) -> float:
    """Elements each rank sends and receives per step (ZeRO §7): data parallelism's
    all-reduce moves 2Ψ (a reduce-scatter and an all-gather of Ψ each); stages 1 and 2 the
    same 2Ψ; stage 3 3Ψ (parameters all-gathered in forward and again in backward, gradients
    reduce-scattered), i.e. 1.5× data parallelism."""
    _check_stage(stage)
    return 3 * n_params if stage == 3 else 2 * n_params


def _check_stage(stage: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={stage}: choose 0, 1, 2 or 3")


# --- activations --------------------------------------------------------------------------

def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, *, ffn: int | None = None,
                               mlp: str = "gelu", value_bytes: int = 2, dropout: bool = True,
                               fused_attention: bool = False, checkpointing: str = "none",
                               tensor_parallel: int = 1, sequence_parallel: bool = False,
                               kv_heads: int | None = None, experts_per_token: int = 1,
                               router_experts: int = 0) -> float:
    """Activation bytes one transformer layer keeps for backward.

    Korthikanti et al. 2022, §4.1-4.2 (Table 2), for a GPT layer with 16-bit values
    (``value_bytes=2``) and 1-byte dropout masks:
      attention 11sbh + 5as²b: QKV input 2sbh, Q and K 4sbh, softmax output 2as²b, its
        dropout mask as²b and output 2as²b, V 2sbh, projection input 2sbh, dropout mask sbh;
      MLP 19sbh: input 2sbh, GeLU input 8sbh and output 8sbh (4h wide), dropout mask sbh;
      two LayerNorm inputs 4sbh;
    in all s·b·h·(34 + 5·a·s/h). Generalised here, each term as the paper derives it:
      - ``value_bytes`` for every stored value (4 for fp32 activations); masks stay 1 byte;
      - ``dropout=False`` drops the masks and the dropout outputs (the models here train
        without dropout): attention 10sbh + 2as²b, MLP 18sbh;
      - ``ffn`` (default 4h) widens the MLP terms; ``mlp="swiglu"`` (LLaMA) keeps the gate
        and up projections' outputs, the SiLU output and their product (4 × s·b·ffn) where
        GeLU keeps 2;
      - ``fused_attention`` (flash / SDPA kernels) keeps no s×s score matrix: the a·s² terms
        vanish (the kernel's per-row statistics, 4·a·s·b bytes, are kept instead);
      - ``checkpointing="full"``: only the layer input, 2sbh (§4.3); "selective": the
        paper's selective recompute, the attention core (the a·s² terms) recomputed from
        the kept Q, K, V, leaving 34sbh with dropout;
      - ``tensor_parallel=t`` divides the terms computed inside the TP region (24sbh and
        the score terms) by t; ``sequence_parallel`` also the LayerNorm and dropout terms
        (the remaining 10sbh), giving the table's 34sbh/t;
      - ``kv_heads`` (grouped-query attention, Ainslie et al. 2023; multi-query, Shazeer
        2019): K and V are kv_heads/heads as wide as Q, so their terms (2sbh of the paper's
        Q, K and V 6sbh at 2 bytes) scale by kv_heads/heads;
      - ``experts_per_token=k`` (a mixture of experts routing every token to k experts, no
        token dropped: Mixtral, Jiang et al. 2024) keeps the MLP terms k times, and
        ``router_experts=E`` adds the router's fp32 logits, 4·s·b·E.
    With every default (GPT, 16-bit, dropout, unfused, no recompute, t = 1) this is exactly
    the paper's s·b·h·(34 + 5·a·s/h).
    Korthikanti's "selective" is not the harness's selective policy (which saves every
    matmul and attention output): the formula is reported beside the measurement, not as
    its prediction.
    """
    if checkpointing not in ("none", "full", "selective"):
        raise ValueError(f"checkpointing={checkpointing!r}: choose none, full or selective")
    s, b, h, a, t = seq, batch, hidden, heads, tensor_parallel
    f = ffn or 4 * h
    v, mask = value_bytes, (1 if dropout else 0)
    sbh = s * b * h
    if checkpointing == "full":
        return v * sbh / (t if sequence_parallel else 1)
    kv_share = (kv_heads or a) / a
    # Inside the tensor-parallel region (divided by t).
    qk = v * sbh * (1 + kv_share)  # Q and K, the inputs of the score matmul
    value_in = v * sbh * kv_share  # V
    proj_in = v * sbh  # input of the output projection
    if fused_attention:
        scores = 4.0 * a * s * b  # the kernel's fp32 log-sum-exp per row, no s×s matrix
    elif checkpointing == "selective":
        scores = 0.0  # the attention core is recomputed from Q, K, V
    else:  # softmax output; with dropout also its mask and output
        scores = (v + (1 + v if dropout else 0)) * a * s * s * b
    mlp_kept = (2 if mlp == "gelu" else 4) * v * s * b * f * experts_per_token
    inside = qk + value_in + proj_in + scores + mlp_kept
    # Outside it (divided by t only with sequence parallelism): the inputs of the QKV and
    # the first MLP matmul, the two LayerNorm inputs, the two dropout masks.
    # The router (replicated, like the LayerNorms) keeps its fp32 logits.
    outside = v * sbh + v * sbh + 2 * v * sbh + 2 * mask * sbh + 4.0 * s * b * router_experts
    return inside / t + outside / (t if sequence_parallel else 1)


# --- optimizer state -------------------------------------------------------------------------

_BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps 32-bit state for smaller tensors
_BNB_BLOCK = 256  # one fp32 absmax per 256 values, per state
_BNB_QMAP_BYTES = 2 * 256 * 4  # the two 256-entry fp32 quantisation maps, shared by all tensors


def optimizer_state_bytes(shapes: list[tuple[int, ...]] | tuple[tuple[int, ...], ...], optimizer: str) -> float:
    """Bytes of optimizer state for parameters of the given shapes (fp32 parameters).

    - adamw: two fp32 moments, 8 B/param (Kingma & Ba; formulas.md "Optimizer memory"),
      plus one fp32 step counter per tensor.
    - adam8bit / adamw8bit / paged_adamw8bit: Dettmers et al. 2022 block-wise 8-bit: two
      uint8 states (2 B/param) and one fp32 absmax per 256-value block per state; tensors
      under 4096 values keep two fp32 states (bitsandbytes' min_8bit_size); plus the two
      shared quantisation maps.
    - adafactor: Shazeer & Stern 2018, factored second moment: a row and a column statistic
      (n + m values) for an n×m matrix, the full variance for vectors, no first moment
      (torch.optim.Adafactor's default), fp32, plus a step counter per tensor.
    """
    total = 0.0
    any_8bit = False
    for shape in shapes:
        n = math.prod(shape)
        if optimizer == "adamw":
            total += 8 * n + 4
        elif optimizer in BITSANDBYTES:
            if n < _BNB_MIN_8BIT_SIZE:
                total += 8 * n
            else:
                any_8bit = True
                total += 2 * n + 2 * 4 * math.ceil(n / _BNB_BLOCK)
        elif optimizer == "adafactor":
            factored = len(shape) >= 2
            total += 4 * ((math.prod(shape[:-1]) + shape[-1]) if factored else n) + 4
        else:
            raise ValueError(f"optimizer={optimizer!r}: no state formula")
    return total + (_BNB_QMAP_BYTES if any_8bit else 0)


# --- compression -------------------------------------------------------------------------------

POWERSGD_MIN_COMPRESSION_RATE = 2  # torch PowerSGDState's default


def powersgd_elements(shape: tuple[int, ...], rank: int) -> int:
    """Elements all-reduced for one gradient under PowerSGD (Vogels et al. 2019; torch's
    powerSGD_hook): a tensor viewed as m×n (first dimension × the rest) is sent as rank-r
    factors P (m×r) and Q (n×r) when (m + n)·r·min_compression_rate < m·n; otherwise (and
    for vectors) as is."""
    n_total = math.prod(shape)
    if len(shape) < 2:
        return n_total
    m, n = shape[0], n_total // shape[0]
    r = min(rank, m, n)
    compressed = (m + n) * r
    return compressed if compressed * POWERSGD_MIN_COMPRESSION_RATE < m * n else n_total


# --- FLOPs --------------------------------------------------------------------------------------

def model_flops_per_step(batch: int, layers: int, seq: int, hidden: int, vocab: int, *,
                         selective_recompute: bool = False) -> float:
    """Korthikanti et al. 2022, App. A: 72·B·L·s·h²·(1 + s/(6h) + V/(12hL)) model FLOPs per
    step (forward + backward); with selective recompute the hardware FLOPs, s/(3h) in place
    of s/(6h)."""
    attention = seq / (3 * hidden) if selective_recompute else seq / (6 * hidden)
    return 72 * batch * layers * seq * hidden**2 * (1 + attention + vocab / (12 * hidden * layers))


# --- tensor parallelism ---------------------------------------------------------------------

def tp_model_states(sharded: float, replicated: float, tp: int, *, data_parallel: int = 1, param_bytes: float = 4,
                    grad_bytes: float = 4, optimizer_bytes: float = 8) -> ModelStates:
    """Model-state bytes per rank under tensor parallelism (Shoeybi et al. 2019, Megatron-LM
    §3): the column- and row-parallel linear layers' ``sharded`` parameters are split over the
    ``tp`` ranks of a group, the rest (LayerNorms, row-parallel biases, embeddings unless
    vocabulary-parallel) is ``replicated`` on each; every state follows its parameter.
    ``data_parallel=N_d`` then shards each rank's part over N_d ranks, as FSDP / ZeRO-3 does
    (2-D TP × FSDP, torchtitan): (sharded/t + replicated)·(2 + 2 + K)/N_d in ZeRO's terms.
    Defaults: fp32 AdamW, 4 + 4 + 8 bytes per parameter."""
    if tp < 1 or data_parallel < 1:
        raise ValueError(f"tp={tp}, data_parallel={data_parallel}: both must be at least 1")
    local = (sharded / tp + replicated) / data_parallel
    return ModelStates(params=local * param_bytes, grads=local * grad_bytes, optimizer=local * optimizer_bytes)


def tp_all_reduce_bytes(batch: int, seq: int, hidden: int, layers: int, *, forward_bytes: float = 4,
                        backward_bytes: float = 4, recomputed_per_block: int = 0) -> float:
    """Bytes all-reduced per rank per forward + backward under Megatron tensor parallelism
    (Shoeybi et al. 2019, §3, Fig. 4): each transformer block has two all-reduces in forward
    (the g operator after the attention's row-parallel output projection and after the MLP's
    row-parallel second linear) and two in backward (the f operator before the column-parallel
    QKV and first MLP linear), each of the b·s·h activation: 4·L·b·s·h values.

    The two directions can differ in width (under autocast the forward's are in the compute
    dtype, the backward's in the dtype of the block's input), and a recomputed forward
    repeats the all-reduces it reaches (``recomputed_per_block``)."""
    values = layers * batch * seq * hidden
    return values * ((2 + recomputed_per_block) * forward_bytes + 2 * backward_bytes)


# --- pipeline parallelism ---------------------------------------------------------------------

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def pipeline_bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The share of a pipeline step each rank idles, (p−1)/(v·m + p−1).

    GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush; Narayanan et al. 2021, §2.2.1) idle
    (p−1)·(t_f + t_b) in a step of m·(t_f + t_b) work: bubble ÷ ideal = (p−1)/m, a fraction
    (p−1)/(m+p−1) of the step. The interleaved schedule with v model chunks per rank
    (Narayanan et al. 2021, §2.2.2) divides the bubble by v: (p−1)/(v·m) of the ideal time,
    (p−1)/(v·m + p−1) of the step."""
    if min(stages, microbatches, virtual_stages) < 1:
        raise ValueError(f"stages={stages}, microbatches={microbatches}, virtual_stages={virtual_stages}:"
                         " each must be at least 1")
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def pipeline_first_stage_layer_activations(schedule: str, layers: int, stages: int, microbatches: int,
                                           virtual_stages: int = 1) -> float:
    """Activations the first stage holds at its peak, in units of one layer's activations for
    one micro-batch (multiply by ``activation_bytes_per_layer``).

    - gpipe: every micro-batch's forward runs before any backward: m·L/p (Huang et al. 2019);
    - 1f1b: at most p micro-batches in flight on the first stage: min(p, m)·L/p, i.e. L layers'
      worth whatever p (Narayanan et al. 2021 §2.2.1; Korthikanti et al. 2022 §4.2.3);
    - interleaved_1f1b: Megatron's schedule runs (p−1)·2 + (v−1)·p warm-up chunk forwards on
      rank 0, and one more in steady state, each chunk L/(p·v) layers: with m ≥ p that is
      L·(1 + (p−1)/(p·v)), Korthikanti et al. 2022 §4.2.3's interleaving factor."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    p, m, v = stages, microbatches, virtual_stages
    if schedule == "gpipe":
        return m * layers / p
    if schedule == "1f1b":
        return min(p, m) * layers / p
    in_flight_chunks = min(2 * (p - 1) + (v - 1) * p + 1, m * v)
    return in_flight_chunks * layers / (p * v)


def pipeline_stage_layers(layers: int, stages: int) -> list[int]:
    """Consecutive blocks per stage (GPipe, Huang et al. 2019), as evenly as they go, as
    harness/strategies/pipeline.py splits them (``stage_blocks``): the remainder goes to the
    middle stages first, then the first, then the last (the first also embeds, the last also
    runs the LM head), so the first or the last stage may hold no block; a middle one must."""
    counts = [len(blocks) for blocks in pipeline.stage_blocks(layers, stages)] if stages >= 1 else []
    if not counts or 0 in counts[1:-1]:
        raise ValueError(f"stages={stages}: {layers} layers leave a middle stage empty (or no stage at all)")
    return counts


def pipeline_stage_params(block: int, layers: int, stages: int, *, first: int, last: int) -> list[int]:
    """Parameters each pipeline stage holds: its blocks (``pipeline_stage_layers``), the
    embeddings (``first``) on the first stage, the final norm and LM head (``last``) on the
    last. Each stage's optimizer steps its own, so its model states follow from these."""
    params = [n * block for n in pipeline_stage_layers(layers, stages)]
    params[0] += first
    params[-1] += last
    return params


def pipeline_p2p_bytes(batch: int, seq: int, hidden: int, microbatches: int, *, neighbours: int,
                       value_bytes: float = 4) -> float:
    """Bytes a stage sends (and as many it receives) per step: each micro-batch's b·s·h
    activation forward and its gradient backward, over each of its ``neighbours`` (1 for the
    first and last stage, 2 between) (Huang et al. 2019; Narayanan et al. 2021 §3)."""
    return microbatches * batch * seq * hidden * value_bytes * neighbours


def interleaved_1f1b_order(rank: int, ranks: int, microbatches: int, virtual_stages: int) -> list[tuple[int, bool]]:
    """(stage, is_forward) for each computation ``rank`` runs in one step of torch's
    ScheduleInterleaved1F1B, in order: the schedule's own plan
    (``_calculate_single_rank_operations``, which reads only these four sizes), not a copy
    of it. Its rounds (``max(1, m // p)``) make its warm-up differ from Megatron's when p
    does not divide m."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    rounds = max(1, microbatches // ranks)  # as ScheduleInterleaved1F1B.__init__ sets them
    sizes = types.SimpleNamespace(n_local_stages=virtual_stages, pp_group_size=ranks, _n_microbatches=microbatches,
                                  microbatches_per_round=microbatches // rounds)
    actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(sizes, rank)
    return [(a.stage_index, a.computation_type == _ComputationType.FORWARD) for a in actions if a is not None]


def pipeline_peak_in_flight(order: list[tuple[int, bool]], bytes_per_microbatch: dict[int, float]) -> float:
    """The most a rank holds while running ``order``: a forward on a stage keeps that
    micro-batch's activations (``bytes_per_microbatch[stage]``) until its backward frees them."""
    in_flight = dict.fromkeys(bytes_per_microbatch, 0)
    peak = 0.0
    for stage, forward in order:
        in_flight[stage] += 1 if forward else -1
        peak = max(peak, sum(count * bytes_per_microbatch[held] for held, count in in_flight.items()))
    return peak


def pipeline_rank_activations(schedule: str, rank: int, ranks: int, microbatches: int,
                              bytes_per_microbatch: dict[int, float]) -> float:
    """Activation bytes ``rank`` holds at its peak, from each of its stages' bytes for one
    micro-batch: GPipe every micro-batch (Huang et al. 2019); 1F1B p − rank of them
    (Narayanan et al. 2021 §2.2.1); interleaved 1F1B as torch's schedule orders them
    (``interleaved_1f1b_order``; ``pipeline_first_stage_layer_activations`` is Megatron's
    closed form for rank 0)."""
    if schedule == "gpipe":
        return microbatches * sum(bytes_per_microbatch.values())
    if schedule == "1f1b":
        (stage_bytes,) = bytes_per_microbatch.values()
        return min(ranks - rank, microbatches) * stage_bytes
    virtual_stages = len(bytes_per_microbatch)
    return pipeline_peak_in_flight(interleaved_1f1b_order(rank, ranks, microbatches, virtual_stages),
                                   bytes_per_microbatch)


# --- Megatron-core (GPTModel, its DDP and distributed optimizer) -----------------------------------

def megatron_split_numel(spec: ModelSpec) -> int:
    """Parameters Megatron's GPTModel splits over its tensor-parallel ranks: the blocks'
    column- and row-parallel linears (``tp_sharded_numel``) and, vocabulary-parallel, the
    token table (VocabParallelEmbedding) and an untied output layer (ColumnParallelLinear; a
    tied one reuses the table). Position embeddings, norms and row-parallel biases are
    replicated."""
    tables = 1 if spec.family == "gpt2" or spec.tie_embeddings else 2
    return tp_sharded_numel(spec) + tables * spec.vocab_size * spec.hidden


def megatron_model_states(local_params: float, dp: int) -> ModelStates:
    """Bytes per rank of fp32 training under Megatron's DDP and distributed optimizer, for
    the ``local_params`` a rank holds (its tensor-parallel share of its pipeline stage): the
    fp32 parameter and gradient buffers are whole on every data-parallel rank, the
    optimizer's two Adam moments are sharded over the dp ranks, and the fp32 parameters
    serve as the main copy (no master weights): ZeRO-1, 4 + 4 + 8/N_d bytes per parameter
    (Rajbhandari et al. §5)."""
    return zero_model_states(local_params, dp, 1, **FP32_ADAM)


def megatron_tp_all_reduce_bytes(batch: int, seq: int, hidden: int, layers: int, tp: int, *, embeds: bool = True,
                                 head: bool = True, value_bytes: float = 4, recomputed_per_block: int = 0) -> float:
    """Bytes a rank all-reduces over its tensor-parallel group per forward + backward of one
    micro-batch through its ``layers`` (no sequence parallelism): the blocks' four
    all-reduces of b·s·h (``tp_all_reduce_bytes``); on the stage that ``embeds``, the
    vocabulary-parallel embedding's forward all-reduce (b·s·h); on the one with the ``head``,
    the output layer's backward all-reduce of its input gradient (b·s·h) and the
    vocabulary-parallel cross entropy's three fp32 all-reduces of b·s values (the max logit,
    the target's logit, the sum of exponentials), which Megatron issues even at tp = 1 (the
    others it skips there). Megatron's full recompute reruns a whole layer
    (``recomputed_per_block=2``)."""
    activation = batch * seq * hidden * value_bytes
    split = tp_all_reduce_bytes(batch, seq, hidden, layers, forward_bytes=value_bytes, backward_bytes=value_bytes,
                                recomputed_per_block=recomputed_per_block) + activation * (embeds + head)
    return (split if tp > 1 else 0.0) + (3 * batch * seq * 4 if head else 0.0)


def megatron_optimizer_comm_bytes(local_params: float) -> dict[str, float]:
    """The distributed optimizer's traffic per step over the data-parallel group: DDP
    reduce-scatters the fp32 gradient buffer (grad_reduce_in_fp32) and, after the step,
    all-gathers the updated fp32 parameter buffer; in the harness's convention each counts
    the whole buffer, 4 bytes per local parameter (ZeRO §7's 2Ψ). Megatron issues both at a
    data-parallel size of 1 too."""
    return {"reduce_scatter": 4.0 * local_params, "all_gather": 4.0 * local_params}


# --- context parallelism (ring attention) ----------------------------------------------------------

def context_parallel_kv_bytes(batch: int, seq: int, kv_width: int, layers: int, degree: int, *,
                              value_bytes: float = 4, recomputed_per_layer: int = 0) -> dict[str, float]:
    """Bytes per rank per forward + backward of torch's ring attention over ``degree`` ranks
    (torch/distributed/tensor/experimental/_context_parallel/_attention.py, torch 2.13, its
    default rotate method "allgather"): per attention layer the forward all-gathers the
    ranks' K and V once (``_AllGatherRotater``: the gathered output is 2·b·s·kv_width values
    in K and V's dtype), the backward all-gathers them again and passes the fp32 K and V
    gradients (convert_to_f32) round the ring with one all-to-all per ring step
    (``_AllToAllRotater``: ``degree`` × 2·b·(s/degree)·kv_width·4 bytes of input). A
    recomputed forward repeats its all-gather. Nothing at degree 1."""
    if degree == 1:
        return {}
    kv = 2 * batch * seq * kv_width
    return {"all_gather": layers * (2 + recomputed_per_layer) * kv * value_bytes, "all_to_all": layers * kv * 4.0}


# --- mixture of experts -----------------------------------------------------------------------

def moe_params(*, shared: int, expert: int, n_experts: int, top_k: int, layers: int) -> tuple[int, int]:
    """(total, active) parameters of a mixture of experts: every expert is held and trained,
    a token passes through top_k of them per layer (Shazeer et al. 2017; Fedus et al. 2022,
    Switch Transformers; Mixtral, Jiang et al. 2024: 46.7B total, 12.9B active).
    ``shared``: every parameter outside the experts (attention, norms, routers, embeddings,
    head); ``expert``: one expert's parameters. Model states (ZeRO's 16Ψ) scale with the
    total, training FLOPs (6·N per token) with the active count."""
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k}: between 1 and n_experts={n_experts}")
    return shared + layers * n_experts * expert, shared + layers * top_k * expert


def expert_parallel_local_params(*, shared: int, expert: int, n_experts: int, layers: int, ep: int) -> int:
    """Parameters one rank holds under expert parallelism over ``ep`` ranks (GShard, Lepikhin
    et al. 2021; DeepSpeed-MoE, Rajbhandari et al. 2022): everything outside the experts
    whole, as data parallelism keeps it, and n_experts/ep of each MoE layer's experts:
    shared + layers·(n_experts/ep)·expert. Each state follows its parameter."""
    if ep < 1 or n_experts % ep:
        raise ValueError(f"ep={ep}: must divide n_experts={n_experts}")
    return shared + layers * (n_experts // ep) * expert


def expert_parallel_all_to_all_bytes(tokens: int, hidden: int, top_k: int, n_experts: int, layers: int, ep: int, *,
                                     received_rows: float | None = None, value_bytes: float = 4,
                                     recomputed_per_layer: int = 0) -> float:
    """Input bytes of a rank's all-to-alls per forward + backward of its ``tokens`` tokens
    under DeepSpeed AutoEP's dropless dispatch (deepspeed/module_inject/auto_ep_layer.py,
    0.19.8), per MoE layer:
      forward: the int32 per-expert token counts (n_experts values); the dispatch of this
        rank's tokens·top_k routed rows of h values; the return of the ``received_rows``
        rows its own experts computed;
      backward: the return's gradient (tokens·top_k rows) and the dispatch's
        (``received_rows``);
    a recomputed forward repeats its three. The rows a rank sends are fixed, the rows it
    receives depend on the routing: ``received_rows`` defaults to the balanced tokens·top_k,
    which is also exactly the mean over ranks (every rank routes tokens·top_k rows and each
    lands on one rank); ``expert_parallel_most_received_rows`` is the worst case. Nothing at
    ep = 1 (AutoEP computes locally)."""
    if ep == 1:
        return 0.0
    sent = tokens * top_k
    received = sent if received_rows is None else received_rows
    rows = (sent + received) * hidden * value_bytes
    counts = 4 * n_experts
    return layers * ((1 + recomputed_per_layer) * (counts + rows) + rows)


def expert_parallel_most_received_rows(tokens: int, top_k: int, n_experts: int, ep: int) -> int:
    """The most routed rows one rank's experts can receive in a layer: every rank's tokens
    all choosing this rank's experts, each token at most min(top_k, n_experts/ep) of them
    (its top_k experts are distinct): ep·tokens·min(top_k, n_experts/ep)."""
    return ep * tokens * min(top_k, n_experts // ep)


# --- one cell -----------------------------------------------------------------------------------

# Which states a strategy keeps sharded when its optimizer step begins, where that differs
# from its ZeRO stage:
# - every FSDP flavour has resharded its parameters after backward, grad_op included;
# - DeepSpeed ZeRO-1 runs the ZeRO-2 code path with gradient partitioning deferred to the
#   end of backward: it then frees the full gradients, keeping its partition only;
# - FairScale SDP reduces each gradient to its owner, but the other ranks' .grad tensors stay
#   allocated: the harness zeroes them in place (set_to_none silently breaks SDP).
_SHARDS = {
    "single": (), "ddp": (), "fsdp1_no_shard": (),
    "zero1": ("optimizer",), "fairscale_oss": ("optimizer",), "fairscale_sdp": ("optimizer",),
    "deepspeed_zero1": ("optimizer", "grads"), "deepspeed_zero2": ("optimizer", "grads"),
}
_ALL_SHARDED = ("optimizer", "grads", "params")
# DeepSpeed's default stage3_max_live_parameters: a model within it stays gathered from
# forward to backward (measured here: one all-gather per micro-step for the tiny models).
DS_MAX_LIVE_PARAMETERS = 1e9
# Strategies built on torch DDP keep a flat gradient bucket the size of the gradients.
_DDP_BUCKET = frozenset({"ddp", "zero1", "fairscale_oss"})
_LOW = {"bf16": 2, "fp16": 2, "fp32": 4}


def shard_degree(cell: CellSpec, nodes: int = 1) -> int:
    """Ranks a sharded state is split over: the world, or the shard dimension of HSDP."""
    if cell.strategy.name in ("fsdp_hybrid", "fsdp1_hybrid"):
        env = DistEnv(rank=0, world_size=cell.world_size, nnodes=nodes, device=None, backend="")
        return hsdp_shape(env)[1]
    return cell.world_size


def _is_deepspeed(cell: CellSpec) -> bool:
    return cell.strategy.name.startswith("deepspeed_")


def model_states_at_step(cell: CellSpec, layout: ParamLayout, nodes: int = 1) -> dict[str, float]:
    """Bytes per rank held when the optimizer step begins, by category.

    ZeRO's formulas with the cell's engine's byte counts: torch's autocast and FSDP's
    mixed-precision policies keep fp32 parameters and gradients (no master copy: K = the
    optimizer's own state); DeepSpeed keeps parameters and gradients in the compute
    precision and an fp32 master partition (K = 4 + the optimizer's state), as the paper.
    ``buffers``: DDP's flat gradient bucket (one gradient-sized copy; torch DDP,
    ZeroRedundancyOptimizer + DDP, FairScale OSS + DDP); DeepSpeed ZeRO-3's gradient reduce
    bucket, which stays allocated between steps (reduce_bucket_size elements: the model's
    size up to DeepSpeed's default, as harness/strategies/deepspeed_zero.py configures it).
    """
    s = cell.strategy
    shards = _ALL_SHARDED if s.name not in _SHARDS else _SHARDS[s.name]
    degree = shard_degree(cell, nodes)
    psi = layout.numel
    opt = optimizer_state_bytes(layout.shapes, s.optimizer)
    if _is_deepspeed(cell):
        param_bytes = grad_bytes = _LOW[s.precision]
        opt += 4 * psi  # the fp32 master partition
    else:
        param_bytes = grad_bytes = 4

    def per_rank(nbytes: float, kind: str) -> float:
        return nbytes / degree if kind in shards else nbytes

    grads = psi * grad_bytes
    if s.name in _DDP_BUCKET:
        buffers = grads
    elif s.name == "deepspeed_zero3":
        buffers = min(psi, deepspeed_zero.DEFAULT_BUCKET_ELEMENTS) * grad_bytes
    else:
        buffers = 0.0
    return {
        "params": per_rank(psi * param_bytes, "params"),
        "grads": per_rank(grads, "grads"),
        "optimizer": per_rank(opt, "optimizer"),
        "buffers": buffers,
    }


def attention_is_fused(cell: CellSpec) -> bool:
    """SDPA and flash kernels keep no s×s score matrix; eager attention keeps the softmax
    output for its backward (Korthikanti's 5·a·s²·b term; Dao et al. 2022, FlashAttention)."""
    return cell.attention != "eager"


def activation_bytes(cell: CellSpec, spec: ModelSpec) -> dict[str, float]:
    """Korthikanti's per-layer activations × layers for one micro-batch, plus the logits.

    Text and ViT transformers only (the MLP model has no attention: 0). The models here run
    without dropout; activations are fp32 under fp32 and, under autocast, mostly 16-bit. The
    logits term is the fp32 s·b·V output of the LM head that the loss keeps (HF upcasts
    logits to fp32), which Korthikanti leaves out.
    The attention follows ``cell.attention``: fused (sdpa, flash) keeps no scores and takes
    grouped K and V as they are; eager keeps the softmax output, and transformers expands
    grouped K and V to every head (repeat_kv) before its score matmuls, so it keeps them full
    width. A tensor-parallel cell divides the TP region's terms by its degree (no sequence
    parallelism); a mixture of experts keeps each token's expert MLP terms top_k times.
    """
    if spec.family == "mlp":
        return {"per_layer": 0.0, "layers": 0.0, "logits": 0.0}
    fused = attention_is_fused(cell)
    moe = spec.family == "moe"
    per_layer = activation_bytes_per_layer(
        spec.tokens_per_sample, cell.micro_batch, spec.hidden, spec.n_heads, ffn=spec.ffn,
        mlp="swiglu" if spec.family in ("llama", "moe") else "gelu", value_bytes=_LOW[cell.strategy.precision],
        dropout=False, fused_attention=fused, checkpointing=cell.strategy.checkpointing,
        tensor_parallel=tensor_parallel_degree(cell), kv_heads=spec.kv_heads if fused else spec.n_heads,
        experts_per_token=spec.top_k if moe else 1, router_experts=spec.n_experts if moe else 0)
    logits_width = spec.vocab_size or spec.num_classes
    return {
        "per_layer": per_layer,
        "layers": per_layer * spec.n_layers,
        "logits": 4.0 * spec.tokens_per_sample * cell.micro_batch * logits_width
        if spec.family != "vit" else 4.0 * cell.micro_batch * logits_width,
    }


def comm_bytes_per_step(cell: CellSpec, layout: ParamLayout, nodes: int = 1) -> dict[str, float]:
    """Payload bytes per collective kind per optimizer step, in the harness's convention
    (harness/measure/comm.py: all-reduce the tensor, all-gather the gathered output,
    reduce-scatter the full input), so it compares with the counted bytes directly.

    From ZeRO §7 and the FSDP paper §3.2, per engine: DDP all-reduces the gradients once per
    step (fp32, or half with an fp16 hook; PowerSGD the factors of ``powersgd_elements``);
    ZeRO-1 over DDP adds a broadcast of the updated parameters (torch and FairScale OSS);
    FairScale SDP reduces to each owner and broadcasts; FSDP all-gathers the parameters
    (in the compute dtype) in forward and, resharded, again in backward, and
    reduce-scatters fp32 gradients; with accumulation the gathers repeat per micro-step
    while the reduction happens once; FSDP1 keeps the root unit gathered between forward and
    backward; HSDP also all-reduces each shard over the replicate dimension; DeepSpeed
    ZeRO-1/2 all-reduces the gradients and all-gathers the updated partitions, ZeRO-3
    gathers in forward and, when the model exceeds its live-parameter budget
    (stage3_max_live_parameters), again in backward, and reduce-scatters, each micro-step.
    Scalars (loss-scale and overflow flags) are left out.
    """
    s = cell.strategy
    psi, a = layout.numel, s.accumulation
    low = _LOW[s.precision]
    name = s.name
    if name in ("ddp", "zero1", "fairscale_oss"):
        if s.compression == "powersgd":
            reduced = 4 * sum(powersgd_elements(shape, s.powersgd_rank) for shape in layout.shapes)
        else:
            reduced = psi * (2 if s.compression in ("fp16", "bf16") else 4)
        out = {"all_reduce": reduced}
        if name != "ddp":
            out["broadcast"] = 4 * psi
        return out
    if name == "fairscale_sdp":
        return {"reduce": 4 * psi, "broadcast": 4 * psi}
    if name == "fsdp1_no_shard":
        return {"all_reduce": 4 * psi}
    if name.startswith("fsdp") or name == "fairscale_fsdp":
        gather = low * psi
        if name in ("fsdp_grad_op", "fsdp1_grad_op"):
            gathers = gather * a
        elif name.startswith("fsdp1") or name == "fairscale_fsdp":  # FSDP1 grew out of FairScale's
            gathers = (2 * gather - low * layout.root_numel) * a
        else:
            gathers = 2 * gather * a
        out = {"all_gather": gathers, "reduce_scatter": 4 * psi}
        if name.endswith("hybrid"):
            out["all_reduce"] = 4 * psi / shard_degree(cell, nodes)
        return out
    if name in ("deepspeed_zero1", "deepspeed_zero2"):
        return {"all_reduce": low * psi, "all_gather": low * psi}
    if name == "deepspeed_zero3":
        gathers = 1 if psi <= DS_MAX_LIVE_PARAMETERS else 2
        return {"all_gather": gathers * low * psi * a, "reduce_scatter": low * psi * a}
    return {}  # single: nothing to communicate


def comm_volume(by_op: dict[str, float]) -> float:
    """Bytes each rank moves, ZeRO §7's convention: an all-reduce counts twice (its
    reduce-scatter and all-gather halves), the others once."""
    return sum(nbytes * (2 if op == "all_reduce" else 1) for op, nbytes in by_op.items())


def offloaded_bytes(cell: CellSpec, states: dict[str, float]) -> dict[str, float]:
    """Which model states live in host memory rather than on the device (ZeRO-Offload,
    Ren et al. 2021; FSDP CPUOffload): parameter offload moves the sharded parameters and
    gradients, optimizer offload the gradients' fp32 copy, master weights and moments."""
    o = cell.strategy.offload
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    if o in ("params", "optimizer_params"):
        out["params"] = states["params"]
        if not _is_deepspeed(cell):  # FSDP's CPU offload keeps sharded gradients on the host
            out["grads"] = states["grads"]
    if o in ("optimizer", "optimizer_params"):
        out["optimizer"] = states["optimizer"]
        out["grads"] = states["grads"]
    return out


def transient_bytes(cell: CellSpec, layout: ParamLayout, spec: ModelSpec) -> dict[str, float]:
    """Tensors that exist only during forward and backward, beside the model states:

    - ``gathered``: sharded parameters gathered for compute (FSDP, ZeRO-3): the root unit
      (embeddings and head, gathered for the whole step) and two blocks (the one computing
      and the one prefetched), in the compute dtype (DeepSpeed's ZeRO-3 estimator reserves
      the largest layer the same way); FSDP's grad_op (SHARD_GRAD_OP) keeps every unit
      gathered from forward to the end of backward, and so does DeepSpeed ZeRO-3 for a model
      within its live-parameter budget;
    - ``autocast_copies``: torch autocast caches a 16-bit copy of every weight it casts
      for the rest of the forward (DDP, ZeRO-1 and the reference under bf16/fp16);
    - ``recompute``: with full checkpointing, one block's activations exist again while its
      backward recomputes them.
    """
    s = cell.strategy
    low = _LOW[s.precision]
    params_sharded = "params" in (_ALL_SHARDED if s.name not in _SHARDS else _SHARDS[s.name])
    gathered = low * (layout.root_numel + 2 * layout.block_numel) if params_sharded else 0.0
    keeps_all_gathered = s.name in ("fsdp_grad_op", "fsdp1_grad_op") or (
        s.name == "deepspeed_zero3" and layout.numel <= DS_MAX_LIVE_PARAMETERS)
    if keeps_all_gathered:
        gathered = low * layout.numel  # gathered in forward, kept through backward
    uses_autocast = s.precision != "fp32" and not params_sharded and not _is_deepspeed(cell)
    recompute = 0.0
    if s.checkpointing == "full" and spec.family != "mlp":
        recompute = activation_bytes(dataclasses.replace(
            cell, strategy=dataclasses.replace(s, checkpointing="none")), spec)["per_layer"]
    return {"gathered": gathered, "autocast_copies": 2.0 * layout.numel if uses_autocast else 0.0,
            "recompute": recompute}


# --- which cells the analytic model describes ---------------------------------------------------

# The data-parallel and sharded strategies of ZeRO and FSDP (the functions above).
DATA_PARALLEL_STRATEGIES = frozenset({
    "single", "ddp", "zero1", "fsdp_full", "fsdp_grad_op", "fsdp_hybrid", "fsdp1_full", "fsdp1_grad_op",
    "fsdp1_no_shard", "fsdp1_hybrid", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3",
    "fairscale_oss", "fairscale_sdp", "fairscale_fsdp"})
TENSOR_PARALLEL_STRATEGIES = frozenset({"tp", "tp_fsdp"})
PIPELINE_SCHEDULE = {"pp_gpipe": "gpipe", "pp_1f1b": "1f1b", "pp_interleaved_1f1b": "interleaved_1f1b"}
# Families whose blocks this module counts (attention, MLP or experts, norms).
TRANSFORMER_FAMILIES = ("gpt2", "llama", "bert", "vit", "moe")
# The residual stream that crosses a pipeline boundary stays fp32 under torch autocast.
_BOUNDARY_BYTES = 4


def tensor_parallel_degree(cell: CellSpec) -> int:
    """Ranks a tensor-parallel group splits each layer over: every rank for tp, the inner
    mesh dimension for tp_fsdp, Megatron's tensor-parallel size for megatron, 1 otherwise."""
    s = cell.strategy
    if s.name == "tp":
        return cell.world_size
    return s.tp_degree if s.name in ("tp_fsdp", "megatron") else 1


def tp_sharded_numel(spec: ModelSpec) -> int | None:
    """Parameters of the blocks' column- and row-parallel linear layers (Megatron §3): the
    attention's Q, K, V (column, their biases split with them) and output projection (row,
    its bias replicated), the MLP's first linear(s) (column) and second (row). None for the
    families whose blocks are not a plain attention + MLP pair (mixture of experts: experts
    are split by expert parallelism, not this)."""
    h, f, d = spec.hidden, spec.ffn, spec.head_dim
    if spec.family == "gpt2":
        per_block = (h * 3 * h + 3 * h) + h * h + (h * f + f) + f * h
    elif spec.family == "llama":
        per_block = h * (spec.n_heads + 2 * spec.kv_heads) * d + spec.n_heads * d * h + 3 * h * f
    else:
        return None
    return spec.n_layers * per_block


def unavailable_reason(cell: CellSpec, spec: ModelSpec) -> str | None:
    """Why the analytic model has no prediction for this cell, or None. A strategy or family
    it does not describe gets none rather than another strategy's formula."""
    name, family = cell.strategy.name, spec.family
    if family not in TRANSFORMER_FAMILIES + ("mlp",):
        return f"family {family}: no activation or parameter formula for it in harness/predict/analytic.py"
    if name in DATA_PARALLEL_STRATEGIES:
        return None
    if name in TENSOR_PARALLEL_STRATEGIES:
        if tp_sharded_numel(spec) is None:
            return f"{name} on family {family}: which of its parameters are split is not modelled (gpt2, llama only)"
        if cell.strategy.optimizer != "adamw":
            return f"{name} with optimizer={cell.strategy.optimizer}: the state formula needs the split shapes"
        return None
    if name == "megatron":
        if family not in ("gpt2", "llama"):
            return f"megatron on family {family}: GPTModel is built for gpt2 and llama only"
        pp = cell.strategy.pp_degree
        if spec.n_layers % pp:
            return f"megatron: {spec.n_layers} layers do not split evenly into pp_degree={pp} stages"
        return None
    if name == "cp":
        if family != "llama":
            return f"cp on family {family}: context parallel is wired for the llama family only"
        return None
    if name == "deepspeed_autoep":
        if family != "moe":
            return f"deepspeed_autoep on family {family}: expert parallelism needs a mixture of experts (moe)"
        if spec.n_experts % cell.world_size:
            return f"deepspeed_autoep: {spec.n_experts} experts do not split evenly over {cell.world_size} ranks"
        if cell.strategy.precision != "fp32":
            return (f"deepspeed_autoep with precision={cell.strategy.precision}: only fp32 is wired"
                    " (DeepSpeed's BF16_Optimizer and its master copies are not modelled)")
        return None
    if name in PIPELINE_SCHEDULE:
        if family not in ("gpt2", "llama"):
            return f"{name} on family {family}: the stage split is modelled for gpt2 and llama only"
        try:
            pipeline_stage_layers(spec.n_layers, pipeline.n_stages(name, cell.world_size))
        except ValueError as e:
            return f"{name}: {e}"
        return None
    return f"strategy {name}: no analytic model for it in harness/predict/analytic.py"


# --- tensor-, pipeline- and context-parallel cells --------------------------------------------------

def _tp_states(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict[str, float]:
    """tp: Megatron's split with fp32 parameters, gradients and AdamW moments (torch
    autocast keeps fp32 parameters: no master copy); tp_fsdp: the same, then sharded over
    the data-parallel dimension (FSDP2 holds ZeRO-3's layout at the optimizer step)."""
    sharded = tp_sharded_numel(spec)
    dp = cell.strategy.data_parallel_size(cell.world_size) if cell.strategy.name == "tp_fsdp" else 1
    states = tp_model_states(sharded, layout.numel - sharded, tensor_parallel_degree(cell), data_parallel=dp)
    step_counters = 4 * len(layout.shapes)  # one fp32 step per tensor, split or not
    return {"params": states.params, "grads": states.grads, "optimizer": states.optimizer + step_counters,
            "buffers": 0.0}


def _tp_comm(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict[str, float]:
    """Megatron's four all-reduces per block (``tp_all_reduce_bytes``) per micro-step, each
    direction in the width noted below; tp_fsdp adds FSDP's gathers (forward and
    backward) and reduce-scatter of each rank's tensor-parallel part."""
    s = cell.strategy
    # tp computes under autocast: the blocks' inputs (norm outputs) stay fp32, so their
    # gradients, the backward all-reduces, are fp32 (tests/test_tensor_parallel.py: gpt2-tiny
    # bf16 98,304 B = 4 × 2-byte forward + 4 × 4-byte backward values of b·s·h); tp_fsdp casts
    # the parameters (FSDP's policy), so there both directions are taken in the compute dtype
    # (not measured yet). A checkpointed block's recompute stops at its last saved tensor and
    # repeats one forward all-reduce, the attention's (tests/test_tensor_parallel.py: full
    # checkpointing, fp32, 163,840 B = 131,072 + 2 blocks × b·s·h × 4 B).
    out = {"all_reduce": s.accumulation * tp_all_reduce_bytes(
        cell.micro_batch, spec.tokens_per_sample, spec.hidden, spec.n_layers, forward_bytes=_LOW[s.precision],
        backward_bytes=4 if s.name == "tp" else _LOW[s.precision],
        recomputed_per_block=int(s.checkpointing != "none"))}
    if s.name == "tp_fsdp":
        sharded = tp_sharded_numel(spec)
        local = sharded / s.tp_degree + layout.numel - sharded
        out["all_gather"] = 2 * _LOW[s.precision] * local * s.accumulation
        out["reduce_scatter"] = 4 * local
    return out


def _embedding_numel(spec: ModelSpec) -> int:
    return spec.vocab_size * spec.hidden + (spec.seq_len * spec.hidden if spec.family == "gpt2" else 0)


def _low_precision_copies(cell: CellSpec, local_params: float) -> float:
    """torch autocast caches a 16-bit copy of every weight it casts for the forward."""
    return 2.0 * local_params if cell.strategy.precision != "fp32" else 0.0


def _recompute(cell: CellSpec, spec: ModelSpec) -> float:
    """With full checkpointing one block's activations exist again during its backward."""
    if cell.strategy.checkpointing != "full":
        return 0.0
    unchecked = dataclasses.replace(cell, strategy=dataclasses.replace(cell.strategy, checkpointing="none"))
    return activation_bytes(unchecked, spec)["per_layer"]


def _pipeline_ranks(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> list[dict]:
    """Each rank's model states (fp32 AdamW), activations at its peak and transfers.

    A rank holds v stages (stage i on rank i mod p: v = 1, or 2 for the interleaved
    schedule, harness/strategies/pipeline.py). The embeddings sit on the first stage, the
    final norm and a V×h LM head on the last (a tied head is a copy there: the last stage
    computes the logits); the last stage also keeps its micro-batches' logits. In flight at a
    rank's peak: ``pipeline_rank_activations``. Every boundary carries each micro-batch's
    b·s·h hidden states forward and their gradient back (``pipeline_p2p_bytes``); torch's
    PipelineStage keeps one receive buffer per micro-batch for each (a non-first stage's
    inputs, a non-last stage's output gradients) from step to step: the ``buffers``, as
    many bytes as the rank receives. A tied table's two copies (first and last stage) send
    each other their gradients once a step."""
    s, p = cell.strategy, cell.world_size
    m, schedule = s.pp_microbatches, PIPELINE_SCHEDULE[s.name]
    n_stages = pipeline.n_stages(s.name, p)
    first = _embedding_numel(spec)
    tied = spec.family == "gpt2" or spec.tie_embeddings
    last = layout.root_numel - first + (spec.vocab_size * spec.hidden if tied else 0)
    params = pipeline_stage_params(layout.block_numel, spec.n_layers, n_stages, first=first, last=last)
    acts = activation_bytes(cell, spec)
    per_microbatch = [layers * acts["per_layer"] for layers in pipeline_stage_layers(spec.n_layers, n_stages)]
    per_microbatch[-1] += acts["logits"]
    ranks = []
    for rank in range(p):
        mine = range(rank, n_stages, p)
        n_params = sum(params[i] for i in mine)
        received = pipeline_p2p_bytes(cell.micro_batch, spec.tokens_per_sample, spec.hidden, m,
                                      neighbours=sum((i > 0) + (i < n_stages - 1) for i in mine),
                                      value_bytes=_BOUNDARY_BYTES)
        swapped = 4.0 * spec.vocab_size * spec.hidden if tied and rank in (0, p - 1) else 0.0
        ranks.append({
            "states": {"params": 4.0 * n_params, "grads": 4.0 * n_params, "optimizer": 8.0 * n_params,
                       "buffers": received},
            "activations": pipeline_rank_activations(schedule, rank, p, m, {i: per_microbatch[i] for i in mine}),
            "transient": {"gathered": 0.0, "autocast_copies": _low_precision_copies(cell, n_params),
                          "recompute": _recompute(cell, spec)},
            "comm": {"send": received + swapped, "recv": received + swapped}})
    return ranks


def _rank_peak(rank: dict) -> float:
    return sum(rank["states"].values()) + rank["activations"] + sum(rank["transient"].values())


def _tp_parts(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict:
    states = _tp_states(cell, spec, layout)
    transient = {"gathered": 0.0, "autocast_copies": _low_precision_copies(cell, states["params"] / 4),
                 "recompute": _recompute(cell, spec)}
    if cell.strategy.name == "tp_fsdp":  # FSDP2 casts itself; it gathers as fsdp_full does
        t = tensor_parallel_degree(cell)
        block = layout.block_numel - tp_sharded_numel(spec) / spec.n_layers * (1 - 1 / t)
        transient["gathered"] = _LOW[cell.strategy.precision] * (layout.root_numel + 2 * block)
        transient["autocast_copies"] = 0.0
    return {"states": states, "activations": activation_bytes(cell, spec), "transient": transient,
            "comm": _tp_comm(cell, spec, layout), "extra": {}}


def _pipeline_parts(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict:
    """The rank whose peak is highest."""
    ranks = _pipeline_ranks(cell, spec, layout)
    peak = max(ranks, key=_rank_peak)
    s = cell.strategy
    virtual_stages = pipeline.n_stages(s.name, cell.world_size) // cell.world_size
    return {"states": peak["states"],
            # The last stage's logits are inside its held total.
            "activations": {"per_layer": activation_bytes(cell, spec)["per_layer"], "layers": peak["activations"],
                            "logits": 0.0},
            "transient": peak["transient"], "comm": peak["comm"],
            "extra": {"bubble_fraction": pipeline_bubble_fraction(cell.world_size, s.pp_microbatches, virtual_stages),
                      "per_rank_peak_bytes": [_rank_peak(r) for r in ranks]}}


def _megatron_stage_params(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> list[float]:
    """Parameters each pipeline stage's tensor-parallel rank holds under Megatron: its
    n_layers / pp blocks with their linears split over tp; the first stage the
    vocabulary-parallel table (and GPT-2's replicated positions); the last the final norm and
    the vocabulary-parallel output layer (a tied one is the table itself at pp = 1, a copy of
    it on the last stage otherwise)."""
    s, vocab_table = cell.strategy, spec.vocab_size * spec.hidden
    tp, pp = s.tp_degree, s.pp_degree
    tied = spec.family == "gpt2" or spec.tie_embeddings
    split_per_block = tp_sharded_numel(spec) / spec.n_layers
    block = layout.block_numel - split_per_block * (1 - 1 / tp)
    norm = layout.root_numel - _embedding_numel(spec) - (0 if tied else vocab_table)
    first = vocab_table / tp + _embedding_numel(spec) - vocab_table
    last = norm + (vocab_table / tp if not tied or pp > 1 else 0.0)
    return pipeline_stage_params(block, spec.n_layers, pp, first=first, last=last)


def _megatron_stages(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> list[dict]:
    """Each pipeline stage's model states, activations at its peak and traffic per step.

    With pp > 1 a step is Megatron's 1F1B (forward_backward_pipelining_without_interleaving)
    over pp_microbatches micro-batches: stage i holds min(pp − i, m) of them
    (``pipeline_rank_activations``), sends and receives each one's fp32 b·s·h hidden states
    (pipeline_dtype) and their gradients over its boundaries, and a tied table's first- and
    last-stage copies all-reduce their fp32 gradients once a step (finalize_model_grads)."""
    s = cell.strategy
    tp, pp = s.tp_degree, s.pp_degree
    forwards = (s.pp_microbatches if pp > 1 else 1) * s.accumulation
    layers = spec.n_layers // pp
    tied = spec.family == "gpt2" or spec.tie_embeddings
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
            all_reduce += 4.0 * spec.vocab_size * h / tp
        comm = {"all_reduce": all_reduce, **megatron_optimizer_comm_bytes(n_params)}
        if pp > 1:
            p2p = pipeline_p2p_bytes(b, seq, h, forwards, neighbours=(i > 0) + (i < pp - 1))
            comm |= {"send": p2p, "recv": p2p}
        per_microbatch = layers * acts["per_layer"] + (logits if last else 0.0)
        stages.append({
            "states": {"params": states.params, "grads": states.grads, "optimizer": states.optimizer,
                       "buffers": 0.0},
            "activations": pipeline_rank_activations("1f1b", i, pp, forwards, {i: per_microbatch}),
            "transient": {"gathered": 0.0, "autocast_copies": 0.0, "recompute": _recompute(cell, spec)},
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
    if cell.strategy.pp_degree > 1:
        extra = {"bubble_fraction": pipeline_bubble_fraction(cell.strategy.pp_degree, cell.strategy.pp_microbatches),
                 "per_stage_peak_bytes": [_rank_peak(st) for st in stages]}
    return {"states": peak["states"],
            "activations": {"per_layer": acts["per_layer"], "layers": peak["activations"], "logits": 0.0},
            "transient": peak["transient"], "comm": peak["comm"], "extra": extra}


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
    shard = dataclasses.replace(spec, seq_len=spec.seq_len // degree)
    ring = context_parallel_kv_bytes(cell.micro_batch, spec.tokens_per_sample, spec.kv_heads * spec.head_dim,
                                     spec.n_layers, degree, value_bytes=_LOW[s.precision],
                                     recomputed_per_layer=int(s.checkpointing == "full"))
    comm = comm_bytes_per_step(as_ddp, layout) | {op: s.accumulation * nbytes for op, nbytes in ring.items()}
    return {"states": model_states_at_step(as_ddp, layout), "activations": activation_bytes(cell, shard),
            "transient": transient_bytes(as_ddp, layout, shard), "comm": comm, "extra": {}}


Shapes = list[tuple[int, ...]]


def _autoep_shapes(spec: ModelSpec, layout: ParamLayout, ep: int) -> tuple[Shapes, Shapes]:
    """(the non-expert tensors, this rank's expert tensors) as AutoEP holds them: in place of
    each MoE layer's stacked 3-D gate_up_proj and down_proj (the model's only 3-D weights,
    harness/models/moe.py) its GroupedExperts' w1, w3 (E/ep × ffn × h) and w2 (E/ep × h × ffn)
    (deepspeed/moe/ep_experts.py): the same values in three tensors, which counts for the
    optimizer's per-tensor state."""
    shared = [shape for shape in layout.shapes if len(shape) != 3]
    local, h, f = spec.n_experts // ep, spec.hidden, spec.ffn
    experts = [(local, f, h), (local, h, f), (local, f, h)] * spec.n_layers
    return shared, experts


def _expert_parallel_parts(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict:
    """deepspeed_autoep (fp32; harness/strategies/expert_parallel.py), every rank alike, its
    expert-parallel group the whole world:
    - model states: ``expert_parallel_local_params`` in fp32 with their AdamW moments and
      step counters (the client optimizer steps the rank's own tensors); ZeRO stage 0 keeps
      no gradient bucket or master copy (measured on moe-tiny: 104 B beyond the states, the
      64 B of buffers the single-process model holds too, AutoEP's fp32 per-expert token
      counts, 16 B per layer, and an 8 B scalar);
    - communication: one fp32 all-reduce of every local gradient per step (the non-expert
      ones over all ranks, the experts' over their expert-data-parallel group: one rank here,
      still issued and counted) and ``expert_parallel_all_to_all_bytes`` per micro-step for
      the balanced routing (the mean over ranks; the record holds rank 0's, whose routing may
      differ by a few rows); the worst case (``expert_parallel_most_received_rows``) is
      reported beside it as ``all_to_all_worst_case_bytes``;
    - activations: the mixture of experts' (``activation_bytes``), AutoEP's dispatch buffers
      left out."""
    s, ep = cell.strategy, cell.world_size
    shared, experts = _autoep_shapes(spec, layout, ep)
    local = expert_parallel_local_params(shared=sum(math.prod(shape) for shape in shared),
                                         expert=3 * spec.hidden * spec.ffn, n_experts=spec.n_experts,
                                         layers=spec.n_layers, ep=ep)
    states = {"params": 4.0 * local, "grads": 4.0 * local,
              "optimizer": optimizer_state_bytes(shared + experts, s.optimizer), "buffers": 0.0}
    tokens = cell.micro_batch * spec.tokens_per_sample

    def all_to_all(received_rows: float | None = None) -> float:
        return s.accumulation * expert_parallel_all_to_all_bytes(
            tokens, spec.hidden, spec.top_k, spec.n_experts, spec.n_layers, ep, received_rows=received_rows,
            recomputed_per_layer=int(s.checkpointing != "none"))

    worst = all_to_all(expert_parallel_most_received_rows(tokens, spec.top_k, spec.n_experts, ep))
    return {"states": states, "activations": activation_bytes(cell, spec),
            "transient": {"gathered": 0.0, "autocast_copies": 0.0, "recompute": _recompute(cell, spec)},
            "comm": {"all_reduce": 4.0 * local, "all_to_all": all_to_all()},
            "extra": {"all_to_all_worst_case_bytes": worst}}


def _model_parallel_parts(cell: CellSpec, spec: ModelSpec, layout: ParamLayout) -> dict:
    """States, activations, transients and communication per rank of a cell that splits the
    model or the sequence rather than (only) the batch."""
    name = cell.strategy.name
    if name in TENSOR_PARALLEL_STRATEGIES:
        return _tp_parts(cell, spec, layout)
    if name == "megatron":
        return _megatron_parts(cell, spec, layout)
    if name == "cp":
        return _cp_parts(cell, spec, layout)
    if name == "deepspeed_autoep":
        return _expert_parallel_parts(cell, spec, layout)
    return _pipeline_parts(cell, spec, layout)


def predict(cell: CellSpec, spec: ModelSpec | None = None, nodes: int = 1) -> dict:
    """The analytic prediction for one cell, per rank; the record's ``predicted.analytic``.

    ``spec`` replaces the cell's preset (``harness plan`` with another sequence length);
    ``nodes`` shapes the HSDP mesh (replicate across nodes). A cell the model does not
    describe (``unavailable_reason``) gets ``{"unavailable": reason}``."""
    spec = spec or models.get_preset(cell.model)
    why = unavailable_reason(cell, spec)
    if why:
        return {"unavailable": why}
    layout = models.param_layout(spec)
    extra = {}
    if cell.strategy.name in DATA_PARALLEL_STRATEGIES:
        states = model_states_at_step(cell, layout, nodes)
        acts = activation_bytes(cell, spec)
        comm = comm_bytes_per_step(cell, layout, nodes)
        transient = transient_bytes(cell, layout, spec)
    else:
        parts = _model_parallel_parts(cell, spec, layout)
        states, acts, comm, transient, extra = (parts[k] for k in ("states", "activations", "comm", "transient", "extra"))
    offloaded = offloaded_bytes(cell, states)
    model_state_bytes = sum(states.values())
    return {
        "model_states_bytes": states,
        "model_state_bytes": model_state_bytes,
        "activation_bytes": acts,
        "transient_bytes": transient,
        # A first-order peak: the states on the device, one micro-batch's activations and
        # the transients all at once (the traced predictor times them exactly).
        "peak_bytes": (model_state_bytes - sum(offloaded.values()) + acts["layers"] + acts["logits"]
                       + sum(transient.values())),
        "offloaded_bytes": offloaded,
        "comm_bytes_by_op": comm,
        "comm_bytes_per_step": sum(comm.values()),
        "comm_volume_per_step": comm_volume(comm),
        "flops_per_token": models.flops_per_sample(spec) / spec.tokens_per_sample,
        "n_params": layout.numel,
        **extra,
    }
