"""Pipeline parallelism with torch.distributed.pipelining: the model cut into stages, each
rank holding its stages and passing activations (forward) and their gradients (backward) to
its neighbours, one micro-batch at a time.

- pp_gpipe: ScheduleGPipe, one stage per rank; every micro-batch's forward, then every
  backward (all micro-batches' activations in flight at the peak).
- pp_1f1b: Schedule1F1B, one stage per rank; after a warm-up of (stages - rank) forwards it
  alternates one forward and one backward, so a rank holds at most that many micro-batches.
- pp_interleaved_1f1b: ScheduleInterleaved1F1B, two stages per rank (virtual stages = 2 ×
  world; stage i on rank i mod world), which shortens the bubble.

The split is written by hand for the causal LMs (gpt2, llama): the tracer (``pipeline()``) is
fragile on HF models. The first stage embeds the tokens, the blocks are split as evenly as
possible, the last stage applies the final norm and the LM head and computes HF's causal-LM
loss. Every stage builds its own causal mask (transformers' ``create_causal_mask``, as the
HF model does for the cell's attention implementation) and llama's stages their own rotary
position embeddings: only the hidden states travel between stages.

Every rank takes the whole global batch (pp_microbatches × micro_batch rows); the schedule
cuts it into micro-batches. The loss of a micro-batch is its mean over its predicted tokens
and the schedule divides the gradients by the number of micro-batches (``scale_grads``), so
the gradients are those of the mean loss over the whole batch: the reference's.

Tied embeddings (gpt2 always; llama where ``tie_embeddings``): the token table is used by
the first stage (lookup) and the last (LM head), which live on different ranks (rank 0 and
rank world-1). Each rank keeps its own copy of the one weight and gets the gradient of its
own use only; after the schedule's backward the two ranks exchange these gradients
(send/recv) and both add them, so both copies get the whole gradient the reference's tied
weight gets and take the same AdamW update: the copies stay equal and the run trains the
reference's model (Megatron-LM's embedding group does the same). The cost is one V × h
gradient sent each way per step and a second copy of the table (with its AdamW state) on
the last rank.

Clipping (``clip_grad_norm``): the global norm spans every stage's gradients, each on its own
rank, so each rank sums its own stages' squares and one all-reduce of that scalar adds them
over the pipeline (the tied table once: ``_clip``); every rank then scales its gradients by the
same factor, as Megatron-LM's get_grad_norm_fp32 and torch's clip_grad_norm_ do.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from harness.features import optimizers
from harness.models import sources
from harness.strategies.base import RECOMPUTE_CHECKPOINTING, Capabilities, EngineModel, Prepared, Strategy, always

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, PreTrainedConfig, PreTrainedModel

    from harness.config import CellSpec
    from harness.distributed import DistEnv

CAPABILITIES = Capabilities(
    precisions=frozenset({"fp32", "bf16"}),
    checkpointing=RECOMPUTE_CHECKPOINTING,
    min_world_size=2,
    # Optimizers whose state is per element (the analytic model's stages hold n × their bytes).
    optimizers=frozenset({"adamw", "sgd"}),
    evaluation=False,
    notes={"evaluation": "a pipeline's forward runs through its schedule, stage by stage: no held-out evaluation wired",
           "fp16": "fp16 needs a GradScaler whose scale and overflow checks span every stage (all"
                   " ranks must skip the same steps); not wired for pipelines: use bf16"},
)

# torch.distributed.pipelining's schedule classes, by name: imported where a pipeline is
# built, since importing it brings in torch._dynamo (a third of a second in every launch).
_SCHEDULES = {"pp_gpipe": "ScheduleGPipe", "pp_1f1b": "Schedule1F1B", "pp_interleaved_1f1b": "ScheduleInterleaved1F1B"}
_STAGES_PER_RANK = {"pp_gpipe": 1, "pp_1f1b": 1, "pp_interleaved_1f1b": 2}
_LAYOUTS = ("gpt2", "llama")


def n_stages(strategy: str, world_size: int) -> int:
    return _STAGES_PER_RANK[strategy] * world_size


def stage_blocks(n_blocks: int, n_stages: int) -> list[range]:
    """The block indices of each stage: counts differ by at most one. The stages that take
    an extra block are the middle ones first, then the first: the first stage also embeds,
    the last also runs the LM head (a V × h matmul) and the loss."""
    base, extra = divmod(n_blocks, n_stages)
    preference = [*range(1, n_stages - 1), 0, n_stages - 1][:extra]
    counts = [base + (i in preference) for i in range(n_stages)]
    starts = [sum(counts[:i]) for i in range(n_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def rank_blocks(strategy: str, n_blocks: int, world_size: int) -> list[int]:
    """The blocks each rank holds: those of its stages (stage s on rank s mod world_size)."""
    stages = stage_blocks(n_blocks, n_stages(strategy, world_size))
    return [sum(len(stages[s]) for s in range(rank, len(stages), world_size)) for rank in range(world_size)]


def busiest_middle_rank(strategy: str, n_blocks: int, world_size: int) -> int | None:
    """The rank between the first and the last with the most blocks (the lowest of equals),
    whose work prices the other middle ranks' (predict/step_time.py); None on two ranks."""
    blocks = rank_blocks(strategy, n_blocks, world_size)
    return max(range(1, world_size - 1), key=blocks.__getitem__, default=None)


def other_ranks_work(world_size: int, work_by_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What prices a pipeline's ranks besides rank 0's work in the step-time predictor
    (predict/step_time.py), from the ranks' dispatched work where counted: "last_rank_work"
    (the LM head and the loss are its stage's) and "middle_rank_work" ({"rank", "work"}, the
    first rank between the first and the last in ``work_by_rank``)."""
    last = world_size - 1
    middle = [rank for rank in sorted(work_by_rank) if 0 < rank < last]
    return {**({"last_rank_work": work_by_rank[last]} if last in work_by_rank else {}),
            **({"middle_rank_work": {"rank": middle[0], "work": work_by_rank[middle[0]]}} if middle else {})}


def combination_problem(cell: CellSpec) -> str | None:
    spec = cell.model_spec
    name, world = cell.strategy.name, cell.world_size
    if spec.layout not in _LAYOUTS:
        return (f"model={cell.model_name}: the pipeline split is written for the causal-LM layouts"
                f" {' and '.join(_LAYOUTS)} (harness/models/spec.py, Layout), not {spec.layout or 'this model'}")
    stages = n_stages(name, world)
    empty = [i for i, blocks in enumerate(stage_blocks(spec.n_layers, stages)) if not blocks and 0 < i < stages - 1]
    if empty:
        return (f"model={cell.model_name} at world_size={world}: {spec.n_layers} blocks cannot fill {stages} stages"
                f" (stages {empty} would hold nothing); use a deeper model or fewer ranks")
    n_micro = cell.strategy.layout("pp_microbatches")
    if name == "pp_1f1b" and n_micro < stages:
        return f"pp_microbatches={n_micro}: Schedule1F1B needs at least one micro-batch per stage ({stages})"
    rounds = max(1, n_micro // world)
    if name == "pp_interleaved_1f1b" and n_micro % rounds:
        return (f"pp_microbatches={n_micro} at world_size={world}: ScheduleInterleaved1F1B needs a multiple of"
                f" its rounds (max(1, pp_microbatches // world_size) = {rounds})")
    return None


class _Stage(nn.Module):
    """One stage of a causal LM: the embedding if first, some blocks, the head if last.

    It takes token ids (first stage) or hidden states and returns hidden states or, on the
    last stage, logits. The family subclasses say how to embed, what else a block needs and
    how to apply the head."""

    # What the family subclasses define: the first stage's embedding, the last stage's head.
    embed: Callable[[torch.Tensor], torch.Tensor]
    head: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, config: PreTrainedConfig, blocks: list[nn.Module], indices: range, first: bool, last: bool):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(blocks)
        # Each block's mask as the model's own forward makes it: a sliding window's where the
        # config gives the block one (Mistral's every block), else the whole causal context.
        windows = sources.config_windows(config, config.num_hidden_layers)
        self.sliding = [windows[i] is not None for i in indices]
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        masks = {sliding: make(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                               position_ids=positions)
                 for sliding, make in ((False, create_causal_mask), (True, create_sliding_window_causal_mask))
                 if sliding in self.sliding}
        extra = self.block_kwargs(hidden, positions)
        for block, sliding in zip(self.blocks, self.sliding, strict=True):
            hidden = block(hidden, attention_mask=masks[sliding], position_ids=positions, **extra)
        return self.head(hidden) if self.last else hidden

    def block_kwargs(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
        return {}


class _GPT2Stage(_Stage):
    def __init__(self, model: GPT2LMHeadModel, blocks: range, first: bool, last: bool):
        body = model.transformer
        super().__init__(model.config, [body.h[i] for i in blocks], blocks, first, last)
        if first:
            self.wte, self.wpe, self.drop = body.wte, body.wpe, body.drop
        if last:
            self.ln_f, self.lm_head = body.ln_f, model.lm_head

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        embedded: torch.Tensor = self.drop(self.wte(input_ids) + self.wpe(positions))
        return embedded

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.ln_f(hidden))
        return logits


class _LlamaStage(_Stage):
    def __init__(self, model: LlamaForCausalLM, blocks: range, first: bool, last: bool):
        body = model.model
        super().__init__(model.config, [body.layers[i] for i in blocks], blocks, first, last)
        self.rotary_emb = body.rotary_emb  # no parameters: every stage computes its own
        if first:
            self.embed_tokens = body.embed_tokens
        if last:
            self.norm, self.lm_head = body.norm, model.lm_head

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded: torch.Tensor = self.embed_tokens(input_ids)
        return embedded

    def block_kwargs(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
        return {"position_embeddings": self.rotary_emb(hidden, position_ids=positions)}

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits


# Keyed by the model's layout: a Mistral or Qwen2 causal LM has the modules _LlamaStage reads.
_STAGE_CLASSES: dict[str, Callable[..., _Stage]] = {"gpt2": _GPT2Stage, "llama": _LlamaStage}


def build_stage(model: PreTrainedModel, layout: str, stage: int, n_stages: int) -> nn.Module:
    """Stage ``stage`` of ``n_stages`` of ``model`` of ``layout`` (its modules, not copies:
    checkpoint wrappers applied to the blocks stay)."""
    cls = _STAGE_CLASSES[layout]
    blocks = stage_blocks(model.config.num_hidden_layers, n_stages)[stage]
    return cls(model, blocks, first=stage == 0, last=stage == n_stages - 1)


def _ties_embeddings(model: PreTrainedModel) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


class PipelineStep:
    """One optimizer step's forward and backward of this rank's stages, through the schedule.

    A plain callable, not a module: the memory tracker's module tracking assumes that
    backward runs after a module's forward has returned, and the schedule runs backwards
    inside the step."""

    def __init__(self, stages: dict[int, nn.Module], n_stages: int, cell: CellSpec, env: DistEnv,
                 vocab_size: int, tied_weight: nn.Parameter | None):
        self.holds_first = 0 in stages
        self.holds_last = n_stages - 1 in stages
        from torch.distributed import pipelining  # (_SCHEDULES)

        pipeline_stages = [pipelining.PipelineStage(module, index, n_stages, env.device)
                           for index, module in stages.items()]
        name = cell.strategy.name
        # Single-stage schedules take their stage, multi-stage ones the list of them.
        self.schedule = getattr(pipelining, _SCHEDULES[name])(
            pipeline_stages if _STAGES_PER_RANK[name] > 1 else pipeline_stages[0],
            n_microbatches=cell.strategy.pp_microbatches,
            # HF's causal-LM loss: labels shifted by one, mean over the micro-batch's predicted
            # tokens; the schedule divides the gradients by the micro-batches (scale_grads).
            loss_fn=functools.partial(ForCausalLMLoss, vocab_size=vocab_size),
            scale_grads=True,
        )
        # Only the ranks of the first and the last stage hold the tied weight (module docstring).
        self.tied_weight = tied_weight if self.holds_first or self.holds_last else None
        self.tie_peer = env.world_size - 1 if self.holds_first else 0

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        self.schedule.step(*((batch["input_ids"],) if self.holds_first else ()),
                           target=batch["labels"] if self.holds_last else None,
                           losses=losses if self.holds_last else None, return_outputs=False)
        if self.tied_weight is not None:
            _add_peer_gradient(self.tied_weight, self.tie_peer)
        if not self.holds_last:
            return None
        # The mean of equal micro-batches' means: the whole batch's mean loss.
        return torch.stack([loss.detach() for loss in losses]).mean()


def _add_peer_gradient(weight: nn.Parameter, peer: int) -> None:
    """Exchange ``weight``'s gradient with ``peer`` and add the peer's: both ranks end with
    the same sum (addition commutes), the gradient of the one tied weight."""
    if weight.grad is None:
        raise RuntimeError(f"the tied embedding has no gradient after the schedule's backward: nothing to send"
                           f" to rank {peer}")
    received = torch.empty_like(weight.grad)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, weight.grad, peer),
                                    dist.P2POp(dist.irecv, received, peer)])
    for work in works:
        work.wait()
    weight.grad += received


def _clip(stages: nn.Module, tied_copy: nn.Parameter | None) -> Callable[[float], torch.Tensor]:
    """Clipping by the global norm of every stage's gradients, each on its own rank: the root
    of the ranks' sums of squares over their own stages' gradients, summed over the pipeline;
    the tied table counted once (``tied_copy``: the last stage's rank's copy, whose gradient
    the exchange made the first's, is left out of the sum). Every gradient is then scaled as
    torch's clip_grad_norm_ scales them (clip_grads_with_norm_), by the same factor on every
    rank, so the step is the reference's clipped step."""
    params = [p for p in stages.parameters() if p.requires_grad]

    def clip(max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None and p is not tied_copy]
        squared = torch.nn.utils.get_total_norm(grads).square()
        dist.all_reduce(squared)
        norm = squared.sqrt()
        if not math.isinf(max_norm):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    return clip


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    from transformers import PreTrainedModel  # loaded with the model already; a registry lookup need not

    # combination_problem admits the causal LMs only, which harness.models builds with transformers.
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"{type(model).__name__}: the pipeline split takes a transformers causal LM"
                        f" ({' or '.join(_LAYOUTS)} layout)")
    stages_total = n_stages(cell.strategy.name, env.world_size)
    # Stage i runs on rank i mod world (the schedules' "loop" placement).
    layout = cell.model_spec.layout
    if layout not in _LAYOUTS:  # combination_problem refused the cell before launch
        raise ValueError(f"model={cell.model_name}: no pipeline split for its layout ({layout})")
    mine = {i: build_stage(model, layout, i, stages_total).to(env.device)
            for i in range(env.rank, stages_total, env.world_size)}
    tied = model.get_input_embeddings().weight if _ties_embeddings(model) else None
    if not isinstance(tied, nn.Parameter | None):
        raise TypeError(f"{type(tied).__name__}: {type(model).__name__}'s token table is not an nn.Parameter")
    step = PipelineStep(mine, stages_total, cell, env, model.config.vocab_size, tied)
    held = nn.ModuleList(mine.values())
    return Prepared(
        model=held,
        optimizer=optimizers.make(held.parameters(), cell.strategy.optimizer, cell.lr),
        memory_module=held,
        data_rank=0,  # every rank takes the whole batch: the model is split, not the batch
        forward_backward=step,
        holds_loss=step.holds_last,
        clip_grad_norm=_clip(held, step.tied_weight if step.holds_last and not step.holds_first else None),
    )


# Micro-batches one optimizer step is cut into, unless a cell sets pp_microbatches.
DEFAULT_PP_MICROBATCHES = 4
# (strategy, the schedule's name in the analytic predictor, summary)
_DECLARED: tuple[tuple[str, Literal["gpipe", "1f1b", "interleaved_1f1b"], str], ...] = (
    ("pp_gpipe", "gpipe", "pipeline parallel, GPipe schedule (torch.distributed.pipelining)"),
    ("pp_1f1b", "1f1b", "pipeline parallel, 1F1B schedule (torch.distributed.pipelining)"),
    ("pp_interleaved_1f1b", "interleaved_1f1b",
     "pipeline parallel, interleaved 1F1B schedule, two stages per rank (torch.distributed.pipelining)"),
)
STRATEGIES = tuple(
    Strategy(
        name=name, summary=summary, engine="torch", families=("pp",), splits_batch=False,
        options={"pp_microbatches": DEFAULT_PP_MICROBATCHES}, pipelined=always, capabilities=CAPABILITIES,
        combination_problem=combination_problem,
        engine_model=EngineModel(analytic="pipeline", pipeline_schedule=schedule), prepare=prepare,
    )
    for name, schedule, summary in _DECLARED
)
