"""What a strategy file declares: one ``Strategy`` object per strategy, holding everything
the rest of the harness knows about it, and what its ``prepare`` returns (``Prepared``).

The registry (``harness.strategies``), the cell checks (``harness.config``), the markers,
the suites and the analytic predictor all read these declarations; no other table names
strategies. The worker's training step is the same for every strategy: everything that
differs lives behind ``Prepared``.

Strategy files take cells by their attributes: they import ``harness.config`` for type
annotations only, because ``harness.config`` validates cells against these declarations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch
    from torch import nn

    from harness.config import CellSpec, StrategySpec
    from harness.distributed import DistEnv

ALL_PRECISIONS = frozenset({"fp32", "bf16", "fp16"})
# Recompute (none, full, selective) and activation offload, which any strategy whose step is
# the data-parallel one takes (features/checkpointing.py).
RECOMPUTE_CHECKPOINTING = frozenset({"none", "full", "selective"})
ALL_CHECKPOINTING = RECOMPUTE_CHECKPOINTING | {"offload"}

Engine = Literal["torch", "deepspeed", "fairscale", "megatron"]
ZeroIdea = Literal["zero1", "zero2", "zero3"]
# The options of a StrategySpec that apply to some strategies only (the rest refuse a value).
LayoutOption = Literal["tp_degree", "pp_degree", "pp_microbatches", "hsdp_mesh"]
ModelState = Literal["optimizer", "grads", "params"]


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """Which feature values a strategy composes with. Anything else is rejected when the
    matrix is built, with the reason, before a process is launched."""

    precisions: frozenset[str] = ALL_PRECISIONS
    checkpointing: frozenset[str] = ALL_CHECKPOINTING
    offload: frozenset[str] = frozenset({"none"})
    optimizers: frozenset[str] = frozenset({"adamw"})
    compression: frozenset[str] = frozenset({"none"})
    accumulation: bool = True
    # Whether the strategy clips gradients by their global norm (``clip_grad_norm``) its
    # engine's way (Prepared.clip_grad_norm, or the engine's own step).
    clipping: bool = True
    # Whether its ranks can evaluate a held-out set with the model's own forward (real-data
    # cells: harness/data.py); a pipeline's forward is its schedule's.
    evaluation: bool = True
    # Whether it can normalise BatchNorm over its data-parallel group (``sync_batch_norm``).
    sync_batch_norm: bool = False
    # Whether it can train with local SGD (``local_sgd_period``: a DDP comm hook and torch's
    # PostLocalSGDOptimizer).
    local_sgd: bool = False
    # Which of StrategySpec's overlap knobs its engine takes (bucket_cap_mb,
    # gradient_as_bucket_view, prefetch, overlap_comm).
    overlap_options: frozenset[str] = frozenset()
    # Which per-block options (StrategySpec.fp32_blocks, offload_blocks) it applies; every
    # strategy that checkpoints takes checkpoint_blocks, as it takes checkpoint_every.
    block_options: frozenset[str] = frozenset()
    # Which of tensor parallelism's plan options (StrategySpec.sequence_parallel,
    # loss_parallel) it applies.
    plan_options: frozenset[str] = frozenset()
    min_world_size: int = 2
    max_world_size: int | None = None
    # Why a value is refused, for the values that need explaining.
    notes: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class EngineModel:
    """What the analytic predictor (harness/predict/analytic.py) needs to know of how an
    engine holds and moves a data-parallel model, beyond the ZeRO paper's formulas.

    ``analytic``: which part of the predictor describes the strategy at all; the fields
    below are read by its data-parallel part only.
    """

    analytic: Literal["data_parallel", "tensor_parallel", "pipeline", "megatron", "context_parallel",
                      "expert_parallel"] = "data_parallel"
    # The model states split over the shard group (ZeRO stage 1: optimizer; 2: + grads; 3: + params).
    sharded: frozenset[ModelState] = frozenset()
    # "hsdp_shard": HSDP splits states over the shard dimension of its (replicate × shard) mesh.
    shard_group: Literal["world", "hsdp_shard"] = "world"
    # DeepSpeed's mixed precision as in the ZeRO paper: parameters and gradients in the
    # compute precision plus an fp32 master partition; torch keeps fp32 parameters instead.
    fp32_master_partition: bool = False
    # A gradient-sized buffer held between steps: DDP's flat bucket (a copy of every gradient)
    # or DeepSpeed ZeRO-3's reduce bucket (reduce_bucket_size elements).
    grad_buffer: Literal["none", "ddp_bucket", "deepspeed_reduce_bucket"] = "none"
    # Parameters kept whole on every rank beside their shard: DeepSpeed ZeRO-3's persistent
    # ones (at most stage3_param_persistence_threshold elements each), gathered once per step.
    persistent_params: Literal["none", "deepspeed_threshold"] = "none"
    # How gradients and parameters cross the ranks in a step:
    # all_reduce: every gradient all-reduced (compression hooks apply); + a broadcast of the
    #   updated parameters where the optimizer state is sharded (ZeRO-1 over DDP);
    # reduce_to_owner: each gradient reduced to its shard's owner, then broadcast (FairScale SDP);
    # gather_and_reduce_scatter: FSDP's parameter gathers and fp32 gradient reduce-scatter;
    # deepspeed: all-reduce + all-gather of partitions (ZeRO-1/2), gathers + reduce-scatter (ZeRO-3).
    comm: Literal["none", "all_reduce", "reduce_to_owner", "gather_and_reduce_scatter", "deepspeed"] = "none"
    # Parameter gathers per micro-step (gather_and_reduce_scatter): once in forward and again in
    # backward; once (the unit stays gathered until its backward); or again in backward for all
    # but the root unit (FSDP1 and FairScale keep the root gathered between the two, as FSDP2
    # does where its root is left at fully_shard's default: tp_fsdp).
    gathers: Literal["forward_and_backward", "forward", "forward_and_backward_but_root"] = "forward_and_backward"
    # Whether every unit stays gathered from forward to the end of backward: never (two blocks
    # at a time), always (SHARD_GRAD_OP) or while the model is within DeepSpeed's
    # stage3_max_live_parameters.
    keeps_gathered: Literal["never", "always", "within_live_parameters"] = "never"
    # How a sharded optimizer state is split: evenly (flat partitions: DeepSpeed, FSDP), or
    # by whole tensors, each to the rank holding the fewest elements so far, the largest
    # first (torch's ZeroRedundancyOptimizer) or in the model's order (FairScale's OSS).
    optimizer_partition: Literal["even", "largest_first", "in_order"] = "even"
    # What zero_grad leaves of the gradients between steps: nothing (set_to_none, so a step's
    # first backward starts without them) or every gradient, zeroed in place (FairScale SDP).
    grads_between_steps: Literal["freed", "zeroed"] = "freed"
    # Whether a unit's unsharded gradients stay held while they are reduce-scattered (FSDP1:
    # its flat parameter's gradient, until the shard is taken), or are freed once copied into
    # the fp32 reduce input (FSDP2's foreach_reduce).
    reduce_holds_unsharded_grads: bool = False
    # Whether a rank's gradient partition exists while the activations are held, rather than
    # from the end of backward on: DeepSpeed ZeRO-2 allocates its flat partition when the
    # first bucket holding gradients a rank owns is reduced, and the rank owning the last
    # layers reduces in the first bucket; ZeRO-3 allocates it when the engine is built
    # (stage3.py's grad_partitions_flat_buffer) and holds it for good.
    grad_partition_in_backward: bool = False
    # Whether the gradient reductions run beside backward, on a stream of their own (the
    # step-time model hides them there on CUDA): None, always (DDP's buckets, FSDP); a bool,
    # DeepSpeed's default for its ``overlap_comm`` (a cell option), off for ZeRO-1/2, which
    # then reduce on the compute stream, and on for ZeRO-3 (ZeRO-1 cannot turn it on).
    overlap_comm_default: bool | None = None
    # What a rank holds of the gradients between the micro-steps of an accumulation: its
    # sharded gradients (reduced every micro-step, or not sharded at all); the same in a
    # buffer of their own, beside the partition each micro-step's backward allocates anew
    # (DeepSpeed ZeRO-2: stage_1_and_2.py keeps the first micro-step's grads_in_partition as
    # all_grad_tensors and adds each later one's into it after its backward, until the
    # boundary); or, for FSDP's micro-steps without gradient sync
    # (set_requires_gradient_sync(False), no_sync) and DeepSpeed ZeRO-1's (which reduces at the
    # accumulation boundary only, torch summing each whole .grad until then), its unsharded
    # ones until the last micro-step reduces them: in fp32 (FSDP2 accumulates in its reduce
    # dtype) or in the compute dtype (FSDP1; DeepSpeed, whose grad_accum_dtype is the model's
    # unless configured). Traced: gpt2-tiny and llama-tiny, 4 micro-steps, fp32 and bf16 (FSDP);
    # measured: the same on 2 gloo ranks, micro-batch 2 and 4 (DeepSpeed: 4 micro-steps hold
    # one rank's grads_in_partition more than 1 under ZeRO-2, every gradient under ZeRO-1).
    accumulated_grads: Literal["sharded", "sharded_beside_partition", "unsharded_fp32",
                               "unsharded_compute"] = "sharded"
    # Whether the 16-bit gradients are gone by the optimizer step of a 16-bit model: DeepSpeed
    # ZeRO-1/2 copy the rank's gradient partition into fp32 for the master weights and free the
    # 16-bit gradients before stepping (stage_1_and_2.py, step: free_grad_in_param_list), where
    # ZeRO-3 keeps its flat gradient buffer for good.
    frees_16bit_grads_before_step: bool = False
    # Whether the optimizer steps the rank's partition a sub-group at a time, its temporaries
    # those of the largest sub-group (DeepSpeed ZeRO-3: deepspeed_zero.largest_sub_group).
    steps_in_sub_groups: bool = False
    # Whether the last rank can hold more than the first, the record's peak being the fullest
    # rank's: DeepSpeed ZeRO-2's last rank owns the last layers, whose gradients are reduced
    # first, and allocates its gradient partition while the activations are still held
    # (gpt2-tiny on 2 ranks: 9.9 % above rank 0; rank 1 traced: the same bytes as measured). The
    # traced predictor steps that rank beside the first (predict/traced.py, traced_ranks), as it
    # does the fullest rank of a whole-tensor optimizer partition (optimizer_partition).
    last_rank_heavier: bool = False
    # The torch pipeline schedule's name in the formulas (pipeline strategies only).
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] | None = None


def _never(spec: StrategySpec) -> bool:
    return False


def _no_problem(cell: CellSpec) -> str | None:
    return None


def _runs_anywhere(cell: CellSpec, device_type: str) -> str | None:
    return None


def _no_layout_families(spec: StrategySpec) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One strategy, declared once in its file."""

    name: str
    # What it is, in a line (the marker catalogue's description).
    summary: str
    engine: Engine
    # Family markers it carries besides its name (``-m fsdp`` selects every FSDP2 strategy).
    families: tuple[str, ...] = ()
    # Families that follow the cell's layout (megatron: tp where it splits layers, pp where it
    # pipelines them).
    layout_families: Callable[[StrategySpec], tuple[str, ...]] = _no_layout_families
    # The ZeRO stage it implements, whatever the engine (Rajbhandari et al. 2020): the
    # ``zero1``/``zero2``/``zero3`` markers and the record's ``zero_idea``.
    zero_idea: ZeroIdea | None = None
    # True: ranks take different samples, in groups of tp_degree × pp_degree ranks that split
    # the model between them. False: every rank takes the same samples (the model or the
    # sequence is split, not the batch).
    splits_batch: bool = True
    # The layout options that apply, with the value a cell that leaves them unset resolves to.
    options: Mapping[LayoutOption, int | str] = field(default_factory=dict)
    # Whether a spec of this strategy cuts each step into pp_microbatches micro-batches.
    pipelined: Callable[[StrategySpec], bool] = _never
    # How pp_microbatches' "applies to" message names this strategy, where it pipelines only
    # in some layouts ("megatron with pp_degree > 1"); None: it always pipelines, or never.
    pipelined_when: str | None = None
    # The strategy that replaces this one where its engine's maintainers recommend moving
    # (FSDP1 → FSDP2, FairScale → torch): ``plan`` recommends only current strategies.
    superseded_by: str | None = None
    capabilities: Capabilities
    # A pair of individually allowed values that cannot go together, or a model this strategy
    # cannot split: refused when the matrix is built (a mistake in the matrix, not a result).
    combination_problem: Callable[[CellSpec], str | None] = _no_problem
    # A world size or model depth the strategy's layout cannot take: CellSpec refuses it.
    layout_problem: Callable[[CellSpec], str | None] = _no_problem
    # Why this hardware cannot run a cell: recorded as an ``unsupported`` result.
    unsupported_reason: Callable[[CellSpec, str], str | None] = _runs_anywhere
    engine_model: EngineModel
    prepare: Callable[[nn.Module, type[nn.Module], CellSpec, DistEnv], Prepared]

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))  # frozen: read-only too

    def data_parallel_size(self, spec: StrategySpec, world_size: int) -> int:
        """How many groups of ranks take different samples (the rest of the mesh splits the model)."""
        if not self.splits_batch:
            return 1
        return world_size // ((spec.tp_degree or 1) * (spec.pp_degree or 1))


def always(spec: StrategySpec) -> bool:
    """``pipelined`` of the pipeline schedules."""
    return True


def _no_op() -> None:
    pass


def _nothing_to_report() -> dict[str, Any]:
    return {}


@dataclass(frozen=True, kw_only=True)
class Prepared:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    # Entered around forward+backward of every micro-step but the last of an optimizer step.
    no_sync: Callable[[], AbstractContextManager[None]] = nullcontext
    # False where the strategy casts parameters itself (FSDP mixed-precision policies).
    use_autocast: bool = True
    # FSDP2 models are measured with FSDPMemTracker, which knows their sharded parameters.
    fsdp2: bool = False
    # torch 2 zeroes gradients by setting them to None; FairScale's ShardedDataParallel
    # keeps references to the .grad tensors and silently reduces wrong gradients then.
    grads_set_to_none: bool = True
    # Engines that own the backward pass and the optimizer step (DeepSpeed) replace the
    # GradScaler path: ``backward(loss)`` for each micro-step's (already 1/accumulation
    # scaled) loss, ``after_micro_step()`` after each, and no optimizer step of the harness.
    backward: Callable[[torch.Tensor], None] | None = None
    after_micro_step: Callable[[], None] = _no_op
    # The tensors the memory tracker should attribute as model and optimizer state, where
    # the engine's wrappers hide them (DeepSpeed: engine.module, the wrapped torch optimizer).
    memory_module: nn.Module | None = None
    memory_optimizer: torch.optim.Optimizer | None = None
    # Tensors the engine made before the step and holds outside both (DeepSpeed's fp32
    # master partitions and ZeRO-3's parameter partitions): the tracker cannot find them.
    memory_held: Callable[[], list[torch.Tensor]] = list
    # The tensors its backward all-reduces are buffers it keeps from step to step, made where
    # no Python object reaches them (DDP's gradient buckets): the memory step counts them from
    # its start, taken from the step before's (measure/memory.py, all_reduced_buffers).
    all_reduces_kept_buffers: bool = False
    # Engine-specific measurements for the record's per-rank ``engine`` entry (DeepSpeed's
    # comms_logger and memory estimators), read after the last step.
    engine_report: Callable[[], dict[str, Any]] = _nothing_to_report
    # Which share of each step's samples this rank takes: the index of its data-parallel
    # group (None: its rank). Ranks that split the model rather than the batch (tensor and
    # pipeline parallel) share an index; how many groups there are is the cell's
    # ``strategy.data_parallel_size``.
    data_rank: int | None = None
    # Strategies that run forward and backward of a micro-step themselves (a pipeline's
    # schedule, context parallel's sharded sequence): given the micro-step's batch, it
    # backpropagates that micro-step's loss already divided by the accumulation count (as the
    # worker's own path does) and returns it on the ranks that compute one (``holds_loss``),
    # None on the others. None: the worker's own forward and backward.
    forward_backward: Callable[[dict[str, torch.Tensor]], torch.Tensor | None] | None = None
    holds_loss: bool = True
    # Entered around every micro-step's forward and backward and around the held-out
    # evaluation: torch's loss_parallel, where the cross-entropy of vocabulary-split logits
    # is dispatched in both directions (strategies/tensor_parallel.py).
    loss_context: Callable[[], AbstractContextManager[None]] = nullcontext
    # The loss scaler of an fp16 step where torch's GradScaler would be wrong: FSDP's sharded
    # gradients need a scaler that agrees on an overflow over every rank (ShardedGradScaler).
    # None: precision.grad_scaler's.
    scaler: torch.amp.GradScaler | None = None
    # The global norm of this step's (unscaled) gradients, clipping them to ``max_norm`` first
    # where it is finite (features/clipping.py): the engine's own where its gradients are
    # sharded (FSDP1, FairScale OSS). None: torch's over the optimizer's parameters.
    clip_grad_norm: Callable[[float], torch.Tensor] | None = None
    # Engines that own the optimizer step (DeepSpeed) keep the step's numerics themselves:
    # read after each step, the loss scale in use (None without one), the steps skipped for
    # overflow so far, and the gradient norm before clipping (None where not computed).
    engine_numerics: Callable[[], tuple[float | None, int, float | None]] | None = None

    @property
    def owns_optimizer_step(self) -> bool:
        return self.backward is not None


# Both FSDP generations: bf16 and fp16 via their mixed-precision policies (fp16 with torch's
# ShardedGradScaler: Prepared.scaler).
FSDP_CAPABILITIES = Capabilities(offload=frozenset({"none", "params"}))
# Blocks kept in fp32 where the step runs under autocast (features/precision.py).
AUTOCAST_BLOCK_OPTIONS = frozenset({"fp32_blocks"})
