"""What a cell is: the frozen, validated description of one benchmark measurement.

A cell = (model, strategy with its feature options, micro-batch, world size, steps, seed).
Everything here is pure data: it imports no torch, serialises to JSON as it is, and refuses
bad values in ``__post_init__`` with a message that names the allowed values. Whether a
strategy *can* combine with a feature is the strategy's business (harness/strategies/);
whether this machine can run it is decided at launch (``unsupported`` is a result).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from harness import strategies
from harness.features.compression import POWERSGD_START_ITER
from harness.models.presets import PRESETS
from harness.models.spec import ModelSpec
from harness.strategies.base import LayoutOption

Precision = Literal["fp32", "bf16", "fp16"]
# offload: no recompute; what the blocks save for backward goes to host memory and back
# (torch's save_on_cpu, pinned: features/checkpointing.py).
Checkpointing = Literal["none", "full", "selective", "offload"]
Offload = Literal["none", "params", "optimizer", "optimizer_params"]
Optimizer = Literal["adamw", "adam8bit", "adamw8bit", "paged_adamw8bit", "adafactor", "sgd", "lamb", "lamb8bit",
                    "fused_lamb"]
Compression = Literal["none", "fp16", "bf16", "powersgd", "int8_tensor", "int8_channel", "topk", "randomk"]
LossScaling = Literal["dynamic", "none"]
HsdpMesh = Literal["explicit", "fsdp_default"]
# Where a cell's samples come from (harness/data.py): random ones, the standard library's
# source as bytes, or scikit-learn's digits; the real sources' training sets, in samples (a
# global batch must divide them, so that every epoch is whole steps).
DataSource = Literal["synthetic", "stdlib_bytes", "digits"]
TRAIN_SAMPLES = {"stdlib_bytes": 1600, "digits": 1440}
BYTE_VOCABULARY = 256
DIGITS_IMAGE = {"image_size": 8, "num_classes": 10}
# transformers' attn_implementation: "eager" materialises the attention scores, "sdpa"
# calls torch's scaled_dot_product_attention (a fused kernel where the device has one),
# "flash" is flash_attention_2 (the flash-attn package, CUDA only).
Attention = Literal["sdpa", "eager", "flash"]
# torch.cuda.empty_cache(): never, after every optimizer step, or after every micro-step too.
EmptyCache = Literal["never", "step", "micro_step"]

# The strategy every cell is checked against (CellSpec.reference): one process, the whole batch.
REFERENCE = "single"
# DDP rebuilds its buckets during the first steps: memory measured before then is not the
# steady state (cpu-gloo-facts.md, "Measuring on CPU").
MIN_WARMUP = 2


def _check_choice(field_name: str, value: object, allowed: tuple[object, ...]) -> None:
    if value not in allowed:
        choices = ", ".join(str(a) for a in allowed)
        raise ValueError(f"{field_name}={value!r}: choose one of {choices}")


def min_warmup(strategy: StrategySpec) -> int:
    """Steps before a strategy's steps are all alike (the default warm-up): PowerSGD
    allocates its error-feedback state in its first compressed step."""
    return POWERSGD_START_ITER + 1 if strategy.compression == "powersgd" else MIN_WARMUP


MAX_LR = 1e3  # beyond any learning rate a model trains at (and refuses inf and nan)
# The most of any count a cell takes (steps, ranks, samples, ...): beyond it a value is a typo.
MAX_COUNT = 2**20


# torch's allocator refuses a max_split_size_mb at or below its large-buffer size (20 MiB).
MIN_MAX_SPLIT_SIZE_MB = 21


def _check_positive(field_name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise ValueError(f"{field_name}={value!r}: must be a positive integer, at most {MAX_COUNT:,}")


def _check_field_types(spec: object) -> None:
    """Every field of a frozen config holds a value of its declared type, before any other
    check reads it: a suite file (TOML) or a record (JSON) can carry anything. Booleans are
    not integers; an integer is a number; choices (Literal) and models are checked by their
    own rules."""
    hints = _type_hints(type(spec))
    for f in dataclasses.fields(spec):  # type: ignore[arg-type]  # spec is a dataclass instance
        if not f.init:
            continue
        value, allowed = getattr(spec, f.name), _plain_types(hints[f.name])
        if allowed is not None and not _has_type(value, allowed):
            kinds = " or ".join(TYPE_WORDS[t] for t in allowed)
            raise ValueError(f"{f.name}={value!r}: must be {kinds}")


# A config class's resolved field types, resolved once: every spec made (a plan makes
# thousands) checks its fields against them, and typing takes a millisecond to resolve them.
_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    if cls not in _FIELD_TYPES:
        _FIELD_TYPES[cls] = typing.get_type_hints(cls)
    return _FIELD_TYPES[cls]


def _has_type(value: object, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # before int: True is an int to isinstance
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    return isinstance(value, tuple(t for t in allowed if t is not bool))


TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "unset"}


def _plain_types(hint: Any) -> tuple[type, ...] | None:
    """The plain types a field's hint allows (int, float, str, bool, None), or None where it
    names anything else (a choice of literals, a model, a strategy): checked elsewhere."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if any(option not in TYPE_WORDS for option in options):
        return None
    return tuple(options)


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """A parallel strategy and the feature options applied with it."""

    name: str
    precision: Precision = "fp32"
    checkpointing: Checkpointing = "none"
    # Checkpoint every this-many-th block only (0, k, 2k, …), or the listed blocks only
    # (``BlockList``: "0,2,4-7", counted from the input end); None: every block.
    checkpoint_every: int | None = None
    checkpoint_blocks: str | None = None
    # What lives in host memory: parameters, optimizer state, or both.
    offload: Offload = "none"
    # Per-layer precision and offload (a ``BlockList`` each; strategies declare which they
    # take: Capabilities.block_options): the listed blocks compute in fp32 under bf16 or fp16
    # (autocast off inside them, or FSDP2's per-module policy), and keep their parameters,
    # gradients and optimizer state in host memory (FSDP2's per-module CPUOffloadPolicy).
    fp32_blocks: str | None = None
    offload_blocks: str | None = None
    optimizer: Optimizer = "adamw"
    accumulation: int = 1
    compression: Compression = "none"
    # PowerSGD's matrix approximation rank (only read when compression == "powersgd").
    powersgd_rank: int = 1
    # Clip the gradients to this global 2-norm before each optimizer step, the engine's own
    # way (harness/features/clipping.py); None: no clipping.
    clip_grad_norm: float | None = None
    # fp16's loss scaling (features/precision.py): "none" trains fp16 without it, to measure
    # what it loses.
    loss_scaling: LossScaling = "dynamic"
    # BatchNorm over the data-parallel group's samples (torch's SyncBatchNorm) rather than
    # each rank's own; models with BatchNorm only, strategies that declare it.
    sync_batch_norm: bool = False
    # Local SGD (features/local_sgd.py): ranks step on their own gradients and average their
    # parameters every this many steps; None: DDP's all-reduce every step.
    local_sgd_period: int | None = None
    # Communication–computation overlap, each engine's own knob; None or False: the engine's
    # default (strategies declare which they take: Capabilities.overlap_options). DDP's gradient
    # bucket size in MiB and its buckets as the gradients' storage (``gradient_as_bucket_view``);
    # FSDP2's explicit prefetch of the next ``prefetch`` blocks in forward and backward (its
    # implicit default prefetches one); DeepSpeed's ``overlap_comm``.
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    prefetch: int | None = None
    overlap_comm: bool | None = None
    # Each parameter updated (and its gradient freed) in backward, as soon as its gradient is
    # accumulated (features/optimizer_in_backward.py).
    optimizer_in_backward: bool = False
    # HYBRID_SHARD / HSDP: "explicit" builds a (replicate × shard) DeviceMesh;
    # "fsdp_default" lets FSDP1 pick its own process groups, which on a single node silently
    # degrades to NO_SHARD-with-diverging-ranks. It exists so the equivalence gate can be
    # shown to catch that pitfall; suites never select it.
    hsdp_mesh: HsdpMesh = "explicit"
    # The layout options (harness/strategies/base.py, LayoutOption): they apply to the
    # strategies that declare them, and None resolves to the declared default there.
    # tp_fsdp, megatron: ranks per tensor-parallel group (the mesh is data-parallel ×
    # [pipeline ×] tensor-parallel); "tp" uses every rank.
    tp_degree: int | None = None
    # megatron: pipeline stages; the data-parallel size is world_size / (tp_degree × pp_degree).
    pp_degree: int | None = None
    # Tensor parallelism's plan beyond the blocks' matmuls (tp, tp_fsdp: Capabilities.
    # plan_options). ``sequence_parallel``: the norms and the residual stream split along the
    # sequence between the blocks' parallel regions, their entries all-gathers and exits
    # reduce-scatters (Korthikanti et al. 2022; torch's SequenceParallel). ``loss_parallel``:
    # the token embedding and the LM head split by vocabulary, the cross-entropy taken on the
    # split logits (Megatron's vocabulary-parallel layers; torch's loss_parallel).
    sequence_parallel: bool = False
    loss_parallel: bool = False
    # Pipelines (and megatron with pp_degree > 1): the micro-batches one optimizer step is cut
    # into (each of cell.micro_batch samples).
    pp_microbatches: int | None = None

    def __post_init__(self) -> None:
        _check_field_types(self)
        declared = strategies.get(self.name)  # an unknown name is refused, naming the choices
        _check_choice("precision", self.precision, get_args(Precision))
        _check_choice("checkpointing", self.checkpointing, get_args(Checkpointing))
        _check_choice("offload", self.offload, get_args(Offload))
        _check_choice("optimizer", self.optimizer, get_args(Optimizer))
        _check_choice("compression", self.compression, get_args(Compression))
        _check_choice("hsdp_mesh", self.hsdp_mesh, get_args(HsdpMesh))
        _check_positive("accumulation", self.accumulation)
        _check_positive("powersgd_rank", self.powersgd_rank)
        _check_choice("loss_scaling", self.loss_scaling, get_args(LossScaling))
        if self.loss_scaling != "dynamic" and self.precision != "fp16":
            raise ValueError(f"loss_scaling={self.loss_scaling!r}: applies to precision=fp16 only")
        if self.clip_grad_norm is not None and not 0 < self.clip_grad_norm < float("inf"):
            raise ValueError(f"clip_grad_norm={self.clip_grad_norm!r}: must be a positive, finite number (a global"
                             " gradient 2-norm, e.g. 1.0)")
        if self.bucket_cap_mb is not None and not 0 < self.bucket_cap_mb <= MAX_COUNT:
            raise ValueError(f"bucket_cap_mb={self.bucket_cap_mb!r}: must be a positive number of MiB, at most"
                             f" {MAX_COUNT:,}")
        if self.prefetch is not None:
            _check_positive("prefetch", self.prefetch)
        if self.checkpoint_every is not None and not 2 <= self.checkpoint_every <= MAX_COUNT:
            raise ValueError(f"checkpoint_every={self.checkpoint_every!r}: must be an integer of 2 or more"
                             " (every block is the default)")
        for block_option in BLOCK_OPTIONS:
            if (text := getattr(self, block_option)) is not None:  # its canonical spelling: one cell, one id
                object.__setattr__(self, block_option, block_list_text(parse_block_list(block_option, text)))
        partial = [f"{o}={getattr(self, o)!r}" for o in ("checkpoint_every", "checkpoint_blocks") if getattr(self, o)]
        if len(partial) == 2:
            raise ValueError(f"{' and '.join(partial)}: choose one way to name the blocks checkpointed")
        if partial and self.checkpointing not in ("full", "selective"):
            raise ValueError(f"{partial[0]}: applies with checkpointing full or selective")
        if self.fp32_blocks is not None and self.precision == "fp32":
            raise ValueError(f"fp32_blocks={self.fp32_blocks!r}: applies with precision bf16 or fp16 (under fp32"
                             " every block is fp32)")
        if self.offload_blocks is not None and self.offload != "none":
            raise ValueError(f"offload_blocks={self.offload_blocks!r} with offload={self.offload!r}: offload"
                             " applies to every block already; choose one")
        if self.optimizer_in_backward:
            clash = ("accumulation" if self.accumulation > 1 else "clip_grad_norm" if self.clip_grad_norm is not None
                     else "precision=fp16" if self.precision == "fp16"
                     else "a comm hook" if self.compression != "none" or self.local_sgd_period is not None else None)
            if clash:
                raise ValueError(f"optimizer_in_backward with {clash}: each parameter is updated as its gradient"
                                 " is accumulated, before anything could accumulate, clip or unscale it")
        if self.local_sgd_period is not None:
            if not 2 <= self.local_sgd_period <= MAX_COUNT:
                raise ValueError(f"local_sgd_period={self.local_sgd_period!r}: must be an integer of 2 or more (steps"
                                 " between parameter averagings; every step is what DDP does)")
            if self.compression != "none":
                raise ValueError(f"local_sgd_period={self.local_sgd_period} with compression={self.compression!r}:"
                                 " both are DDP communication hooks, and DDP takes one")
        # Options that would change nothing must not make a second cell with a new id.
        if self.powersgd_rank != 1 and self.compression != "powersgd":
            raise ValueError(f"powersgd_rank={self.powersgd_rank}: applies to compression=powersgd only")
        if self.hsdp_mesh != "explicit" and "hsdp_mesh" not in declared.options:
            raise ValueError(f"hsdp_mesh={self.hsdp_mesh!r}: applies to {_declaring('hsdp_mesh')} only")
        # pp_microbatches last: whether it applies can depend on the degrees (megatron).
        for option in ("tp_degree", "pp_degree", "pp_microbatches"):
            self._resolve(option, declared.options.get(option))

    def _resolve(self, option: LayoutOption, default: int | str | None) -> None:
        """A layout option: None becomes the strategy's declared ``default`` where it applies;
        elsewhere any value is refused (it would make a new cell id that changes nothing)."""
        value = getattr(self, option)
        applies = default is not None and (option != "pp_microbatches" or self.pipelined)
        if not applies:
            if value is not None:
                raise ValueError(f"{option}={value!r}: applies to {_declaring(option)} only")
            return
        if value is None:
            object.__setattr__(self, option, default)  # frozen: set once, here
        else:
            _check_positive(option, value)

    def blocks(self, option: BlockOption, n_blocks: int) -> frozenset[int]:
        """The blocks (indices in the model's order) a per-block option names: for
        ``checkpoint_blocks`` the blocks checkpointed, however chosen (all of them, every k-th,
        or the listed ones; none without checkpointing)."""
        if option == "checkpoint_blocks":
            if self.checkpointing == "none":
                return frozenset()
            if self.checkpoint_every:
                return frozenset(range(0, n_blocks, self.checkpoint_every))
            if self.checkpoint_blocks is None:
                return frozenset(range(n_blocks))
        text = getattr(self, option)
        return frozenset() if text is None else frozenset(parse_block_list(option, text))

    def layout(self, option: Literal["tp_degree", "pp_degree", "pp_microbatches"]) -> int:
        """A layout option's value where it applies (resolved to its declared default when the
        spec was made); asking for one that does not apply is a mistake in the caller."""
        value = getattr(self, option)
        if value is None:
            raise ValueError(f"{option}: does not apply to strategy={self.name}")
        return int(value)

    @property
    def pipelined(self) -> bool:
        """A pipeline schedule cuts each step into pp_microbatches micro-batches."""
        return strategies.get(self.name).pipelined(self)

    def data_parallel_size(self, world_size: int) -> int:
        """How many groups of ranks take different samples (the rest of the mesh splits the model)."""
        return strategies.get(self.name).data_parallel_size(self, world_size)


# The options that name blocks by a ``BlockList``: indices into the model's repeated blocks in
# their order, separated by commas, a range written first-last ("0,2,4-7").
BlockOption = Literal["checkpoint_blocks", "fp32_blocks", "offload_blocks"]
BLOCK_OPTIONS: tuple[BlockOption, ...] = get_args(BlockOption)


def parse_block_list(option: str, text: str) -> tuple[int, ...]:
    """A BlockList's indices, sorted; a malformed list is refused, naming the form."""
    indices: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        first, last = (int(match[1]), int(match[2] or match[1])) if match else (0, -1)
        if not first <= last <= MAX_COUNT:
            raise ValueError(f"{option}={text!r}: must list block indices from 0, separated by commas, a range"
                             " written first-last (e.g. \"0,2,4-7\")")
        indices.update(range(first, last + 1))
    return tuple(sorted(indices))


def block_list_text(indices: Iterable[int]) -> str:
    """The canonical BlockList of ``indices``: sorted, each run of consecutive blocks a range."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _block_id(block_list: str) -> str:
    """A BlockList as a cell id spells it: "+" for ",", which pytest's -k grammar lacks."""
    return block_list.replace(",", "+")


def _declaring(option: LayoutOption) -> str:
    """The strategies a layout option applies to, for its refusal."""
    if option == "pp_microbatches":
        always = [s.name for s in strategies.declarations() if s.options.get(option) and s.pipelined_when is None]
        sometimes = [s.pipelined_when for s in strategies.declarations() if s.pipelined_when]
        return f"the pipeline strategies ({', '.join(sorted(always))}) and {' and '.join(sometimes)}"
    names = [s.name for s in strategies.declarations() if option in s.options]
    return f"strategy={names[0]}" if len(names) == 1 else f"strategies {' and '.join(names)}"


@dataclass(frozen=True, kw_only=True)
class CellSpec:
    """One measurement. ``steps`` counts every optimizer step, warm-up included."""

    # A preset's name, or a model resolved from a transformers config or a factory
    # (harness.models.sources.resolve): the ModelSpec then carries everything needed to build it.
    model: str | ModelSpec
    strategy: StrategySpec
    micro_batch: int = 2
    world_size: int = 2
    steps: int = 10
    # None: the fewest steps after which this strategy's steps are steady (min_warmup).
    warmup: int | None = None
    seed: int = 0
    lr: float = 1e-3
    # Tokens per sample of a text model; None: the model's own (the preset's or the config's).
    seq_len: int | None = None
    # Model structure axes: the attention implementation, and (CUDA) the caching allocator's
    # expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).
    attention: Attention = "sdpa"
    expandable_segments: bool = False
    # The rest of the caching allocator's control (CUDA; README "What is measured", "Allocator control"): blocks
    # above this size are never split; reclaim cached blocks once this fraction of the
    # device is held; torch.cuda.empty_cache() after every optimizer step or micro-step.
    max_split_size_mb: int | None = None
    garbage_collection_threshold: float | None = None
    empty_cache: EmptyCache = "never"
    # A mixture of experts' load-balancing loss (Fedus et al. 2022, Switch Transformer §2.2),
    # added to the LM loss with this coefficient; None: off (harness/models/moe.py).
    router_aux_loss_coef: float | None = None
    # Real data (harness/data.py) and, with it, the held-out loss every ``eval_every`` steps.
    data: DataSource = "synthetic"
    eval_every: int | None = None
    # Steps after warm-up: one memory-tracked, one communication-counted, the rest timed.
    # (Both probes add overhead, so they never share a step with the timer.)
    probe_steps: int = field(default=2, init=False)

    def __post_init__(self) -> None:
        _check_field_types(self)
        if not isinstance(self.model, ModelSpec):
            _check_choice("model", self.model, tuple(PRESETS))
        if self.seq_len is not None:
            _check_positive("seq_len", self.seq_len)
            own = self._named_spec()
            if own.family == "factory":
                raise ValueError(f"seq_len={self.seq_len}: model {own.name} is a factory's, which makes its own"
                                 " batches; set the length in the factory")
            if own.seq_len is None:
                raise ValueError(f"seq_len={self.seq_len}: applies to text models; {own.name} is a {own.family}"
                                 " model (its tokens per sample follow from its own sizes)")
            if self.seq_len == own.seq_len:
                object.__setattr__(self, "seq_len", None)  # the model's own: the same cell, the same id
            else:  # ModelSpec refuses a length beyond a config's position table
                dataclasses.replace(own, seq_len=self.seq_len)
        for name in ("micro_batch", "world_size", "steps"):
            _check_positive(name, getattr(self, name))
        least = min_warmup(self.strategy)
        if self.warmup is None:
            object.__setattr__(self, "warmup", least)  # frozen: set once, here
        if self.warmup_steps < least:
            # DDP rebuilds its buckets during the first steps, PowerSGD starts compressing
            # late: memory measured before then is not the steady state (cpu-gloo-facts.md,
            # "Measuring on CPU").
            why = (f"PowerSGD compresses from step {POWERSGD_START_ITER} on" if least > MIN_WARMUP
                   else "DDP rebuilds its buckets in the first steps")
            raise ValueError(f"warmup={self.warmup}: must be at least {least} ({why})")
        if self.steps < self.min_steps:
            raise ValueError(
                f"steps={self.steps}: need at least warmup + {self.probe_steps} probe steps"
                f" + 2 timed steps = {self.min_steps}"
            )
        if not 0 < self.lr <= MAX_LR:
            raise ValueError(f"lr={self.lr!r}: must be a positive number, at most {MAX_LR:g}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed}: must be an integer from 0 to 2**63 - 1 (torch's seed range)")
        if self.strategy.name == REFERENCE and self.world_size != 1:
            raise ValueError(f"strategy={REFERENCE} is the one-process reference: world_size must be 1")
        _check_choice("attention", self.attention, get_args(Attention))
        _check_choice("empty_cache", self.empty_cache, get_args(EmptyCache))
        if self.empty_cache == "micro_step" and self.strategy.accumulation == 1:
            raise ValueError("empty_cache='micro_step' with accumulation=1: a step is one micro-step, so it is"
                             " empty_cache='step'")
        if self.max_split_size_mb is not None and not MIN_MAX_SPLIT_SIZE_MB <= self.max_split_size_mb <= MAX_COUNT:
            raise ValueError(f"max_split_size_mb={self.max_split_size_mb!r}: must be an integer from"
                             f" {MIN_MAX_SPLIT_SIZE_MB} (torch refuses 20 MiB and below) to {MAX_COUNT:,}")
        if self.garbage_collection_threshold is not None and not 0 < self.garbage_collection_threshold < 1:
            raise ValueError(f"garbage_collection_threshold={self.garbage_collection_threshold!r}: must lie between"
                             " 0 and 1 (the fraction of the device's memory at which cached blocks are reclaimed)")
        if self.router_aux_loss_coef is not None:
            if not 0 < self.router_aux_loss_coef < float("inf"):
                raise ValueError(f"router_aux_loss_coef={self.router_aux_loss_coef!r}: must be a positive, finite"
                                 " number (Switch Transformer's is 0.01, transformers' Mixtral default 0.001)")
            if self.model_spec.family != "moe":
                raise ValueError(f"router_aux_loss_coef={self.router_aux_loss_coef:g}: model {self.model_name} is a"
                                 f" {self.model_spec.family} model; the option applies to the moe family's router")
        if self.attention != "sdpa" and not self.model_spec.has_attention:
            raise ValueError(f"attention={self.attention!r}: model {self.model_name} has no attention; leave it 'sdpa'")
        hf = self.model_spec.hf
        if self.attention == "sdpa" and self.model_spec.has_attention and hf is not None and not hf.sdpa:
            raise ValueError(f"attention='sdpa' with model {self.model_name}: transformers' {hf.model_class} computes"
                             " attention without torch's scaled_dot_product_attention; set attention = 'eager'")
        if self.attention == "flash" and self.model_spec.has_attention and hf is not None and not hf.flash:
            raise ValueError(f"attention='flash' with model {self.model_name}: transformers' {hf.model_class} has no"
                             " flash_attention_2 implementation; set attention = 'sdpa' or 'eager'")
        if self.attention == "flash" and self.strategy.precision == "fp32":
            raise ValueError("attention='flash' with precision=fp32: flash-attn computes in fp16 or bf16 only;"
                             " choose precision bf16 or fp16")
        self._check_data()
        s = self.strategy
        if s.sync_batch_norm and not self.model_spec.has_batch_norm:
            raise ValueError(f"sync_batch_norm=True: model {self.model_name} has no BatchNorm layers to synchronise"
                             " (the convnet family has)")
        if problem := strategies.get(s.name).layout_problem(self):
            raise ValueError(problem)
        if s.pipelined and s.accumulation != 1:
            raise ValueError(f"accumulation={s.accumulation} with {s.name}: a pipeline accumulates over its own"
                             " micro-batches; set pp_microbatches instead")
        n_blocks = self.model_spec.n_layers
        for option in BLOCK_OPTIONS:
            beyond = [i for i in s.blocks(option, n_blocks) if i >= n_blocks]
            if beyond:
                raise ValueError(f"{option}={getattr(s, option)!r}: model {self.model_name} has {n_blocks} blocks"
                                 f" (0-{n_blocks - 1}); {beyond[0]} is not one of them")

    def _check_data(self) -> None:
        _check_choice("data", self.data, get_args(DataSource))
        if self.data == "synthetic":
            if self.eval_every is not None:
                raise ValueError(f"eval_every={self.eval_every}: applies to real data only"
                                 " (data=stdlib_bytes or digits)")
            return
        if self.eval_every is not None:
            _check_positive("eval_every", self.eval_every)
        spec = self.model_spec
        if self.data == "stdlib_bytes" and (spec.family not in ("gpt2", "llama")
                                            or (spec.vocab_size or 0) < BYTE_VOCABULARY):
            raise ValueError(f"data={self.data}: needs a causal language model (gpt2, llama) with at least"
                             f" {BYTE_VOCABULARY} tokens (bytes); {spec.name} is a {spec.family} model with"
                             f" {spec.vocab_size} (the gpt2-bytes preset is made for it)")
        if self.data == "digits" and (spec.family != "convnet" or spec.image_size != DIGITS_IMAGE["image_size"]
                                      or spec.num_classes != DIGITS_IMAGE["num_classes"]):
            raise ValueError(f"data={self.data}: needs a convnet model for 8×8 grayscale images of 10 classes;"
                             f" {spec.name} is a {spec.family} model (the convnet-digits preset is made for it)")
        if TRAIN_SAMPLES[self.data] % self.global_batch:
            raise ValueError(f"data={self.data}: its {TRAIN_SAMPLES[self.data]} training samples must split into"
                             f" whole global batches; {self.global_batch} does not divide them")
        if not strategies.get(self.strategy.name).capabilities.evaluation:
            raise ValueError(f"data={self.data} with {self.strategy.name}: "
                             + strategies.get(self.strategy.name).capabilities.notes.get(
                                 "evaluation", "it cannot evaluate a held-out set"))

    def _named_spec(self) -> ModelSpec:
        return self.model if isinstance(self.model, ModelSpec) else PRESETS[self.model]

    @property
    def model_spec(self) -> ModelSpec:
        """The model this cell trains, at the cell's sequence length."""
        spec = self._named_spec()
        return spec if self.seq_len is None else dataclasses.replace(spec, seq_len=self.seq_len)

    @property
    def model_name(self) -> str:
        """The model's short name, as in the cell id (a resolved config's carries its hash)."""
        return self._named_spec().name

    @property
    def warmup_steps(self) -> int:
        """``warmup`` as resolved when the cell was made (never None after that)."""
        if self.warmup is None:
            raise RuntimeError("CellSpec.warmup is resolved in __post_init__")
        return self.warmup

    @property
    def min_steps(self) -> int:
        """The fewest steps this cell accepts: warm-up, the probes and 2 timed steps."""
        return self.warmup_steps + self.probe_steps + 2

    @property
    def timed_steps(self) -> int:
        return self.steps - self.warmup_steps - self.probe_steps

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, over all data-parallel ranks and micro-steps."""
        s = self.strategy
        return (self.micro_batch * s.data_parallel_size(self.world_size) * s.accumulation
                * (s.layout("pp_microbatches") if s.pipelined else 1))

    @property
    def cell_id(self) -> str:
        s = self.strategy
        parts = [self.model_name, s.name, s.precision,
                 f"ckpt_{s.checkpointing}" + (f"-every{s.checkpoint_every}" if s.checkpoint_every else "")
                 + (f"-blocks{_block_id(s.checkpoint_blocks)}" if s.checkpoint_blocks else "")]
        if s.offload != "none":
            parts.append(f"offload_{s.offload}")
        if s.optimizer != "adamw":
            parts.append(s.optimizer)
        if s.accumulation != 1:
            parts.append(f"accum{s.accumulation}")
        if s.compression != "none":
            rank = f"-r{s.powersgd_rank}" if s.compression == "powersgd" else ""
            parts.append(f"compress_{s.compression}{rank}")
        # Each option named only where it is not the default, so adding one keeps every id.
        parts += [tag for tag in (
            f"clip{s.clip_grad_norm:g}" if s.clip_grad_norm is not None else "",
            f"scale_{s.loss_scaling}" if s.loss_scaling != "dynamic" else "",
            "syncbn" if s.sync_batch_norm else "",
            f"localsgd{s.local_sgd_period}" if s.local_sgd_period is not None else "",
            f"bucket{s.bucket_cap_mb:g}" if s.bucket_cap_mb is not None else "",
            "gabv" if s.gradient_as_bucket_view else "",
            f"prefetch{s.prefetch}" if s.prefetch is not None else "",
            f"overlap_comm_{'on' if s.overlap_comm else 'off'}" if s.overlap_comm is not None else "",
            "opt_in_backward" if s.optimizer_in_backward else "",
            "sp" if s.sequence_parallel else "",
            "lossp" if s.loss_parallel else "",
            f"fp32_blocks{_block_id(s.fp32_blocks)}" if s.fp32_blocks else "",
            f"offload_blocks{_block_id(s.offload_blocks)}" if s.offload_blocks else "",
            f"mesh_{s.hsdp_mesh}" if s.hsdp_mesh != "explicit" else "",
        ) if tag]
        # The layout options are None wherever they do not apply (StrategySpec._resolve).
        parts += [f"{tag}{value}" for tag, value in (("tp", s.tp_degree), ("pp", s.pp_degree),
                                                     ("pmb", s.pp_microbatches)) if value is not None]
        if self.attention != "sdpa":
            parts.append(f"attn_{self.attention}")
        if self.expandable_segments:
            parts.append("alloc_expandable")
        if self.max_split_size_mb is not None:
            parts.append(f"alloc_split{self.max_split_size_mb}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"alloc_gc{self.garbage_collection_threshold!r}")
        if self.empty_cache != "never":
            parts.append(f"empty_cache_{self.empty_cache}")
        if self.router_aux_loss_coef is not None:
            parts.append(f"aux{self.router_aux_loss_coef!r}")
        if self.seq_len is not None:
            parts.append(f"seq{self.seq_len}")
        if self.data != "synthetic":
            parts.append(self.data + (f"/eval{self.eval_every}" if self.eval_every else ""))
        parts += [f"mb{self.micro_batch}", f"ws{self.world_size}", f"seed{self.seed}"]
        return "/".join(parts)

    @property
    def evaluates_first(self) -> bool:
        """Whether the held-out loss is taken before the first step (harness/training.py):
        every cell on real data."""
        return self.data != "synthetic"

    def reference(self) -> CellSpec:
        """The single-process run this cell must train identically to.

        Same model, attention, seed, precision (the blocks kept in fp32 too) and loss scaling,
        optimizer, gradient clipping, data and steps; the whole global batch in one process and
        one micro-step, no feature that should not change the maths (checkpointing, offload,
        compression, accumulation, the allocator's settings).
        """
        s = self.strategy
        return dataclasses.replace(
            self,
            strategy=StrategySpec(name=REFERENCE, precision=s.precision, optimizer=s.optimizer,
                                  clip_grad_norm=s.clip_grad_norm, loss_scaling=s.loss_scaling,
                                  fp32_blocks=s.fp32_blocks),
            micro_batch=self.global_batch,
            world_size=1,
            warmup=None,  # its own: the warm-up decides which steps are measured, not the losses
            expandable_segments=False, max_split_size_mb=None, garbage_collection_threshold=None,
            empty_cache="never",
        )

    @property
    def allocator_settings(self) -> str:
        """The CUDA caching allocator's settings the cell runs under, as PYTORCH_CUDA_ALLOC_CONF
        writes them ("" for torch's defaults: harness/training.py sets them per cell)."""
        settings = {"expandable_segments": "True" if self.expandable_segments else None,
                    "max_split_size_mb": self.max_split_size_mb,
                    "garbage_collection_threshold": self.garbage_collection_threshold}
        return ",".join(f"{k}:{v}" for k, v in settings.items() if v is not None)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("probe_steps")
        if isinstance(self.model, ModelSpec):
            d["model"] = self.model.to_dict()  # the whole resolved config, as a JSON object
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CellSpec:
        d = dict(d)
        d["strategy"] = StrategySpec(**d["strategy"])
        if isinstance(d["model"], dict):
            d["model"] = ModelSpec.from_dict(d["model"])
        return cls(**d)


_BYTE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# The sizes parse_bytes reads, by option: a GPU's memory, from a megabyte to far beyond any
# made (H200: 141 GB); a node's host memory for plan (a DGX H100 has 2 TiB).
BYTE_OPTION_RANGES = {"--gpu-mem": (2**20, 2**44, "1 MiB and 16 TiB per GPU"),
                      "--host-mem": (2**20, 2**50, "1 MiB and 1 PiB per node")}


def parse_bytes(text: str, flag: str = "--gpu-mem") -> float:
    """'80GiB', '80 GB', '81920MiB', '8e10B' -> bytes. GB = 1e9, GiB = 2^30. The unit is
    required: a bare 80 is as likely meant as GiB as bytes. ``flag`` names the option in the
    messages and picks its range (``BYTE_OPTION_RANGES``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(f"{flag} {text!r}: give a size with its unit, such as 80GiB, 40GB or 81920MiB"
                         f" (units: {', '.join(_BYTE_UNITS)})")
    value = float(match.group(1)) * _BYTE_UNITS[unit]
    low, high, between = BYTE_OPTION_RANGES[flag]
    if not low <= value <= high:
        raise ValueError(f"{flag} {text!r}: must be between {between}")
    return value


# Network rates as vendors state them, decimal: bits (a NIC's 400 Gb/s, "Gbps" in any case)
# or bytes ("GB/s"; "Gb/s" and "GB/s" are told apart by their case only).
_BANDWIDTH_UNITS = {f"{prefix}{unit}": scale * factor
                    for prefix, scale in (("M", 1e6), ("G", 1e9), ("T", 1e12))
                    for unit, factor in (("bps", 1 / 8), ("b/s", 1 / 8), ("B/s", 1))}


def parse_bandwidth(text: str, flag: str) -> float:
    """'400Gbps', '3.2Tbps', '400Gb/s', '50GB/s' -> bytes a second. The unit is required."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z/]*)\s*", text)
    unit = match.group(2) if match else ""
    unit = unit[0].upper() + unit[1:].lower() if unit.lower().endswith("bps") else unit
    if match is None or unit not in _BANDWIDTH_UNITS:
        raise ValueError(f"{flag} {text!r}: give a rate with its unit, such as 400Gbps, 3.2Tbps or 50GB/s"
                         " (bps and b/s: bits; B/s: bytes)")
    value = float(match.group(1)) * _BANDWIDTH_UNITS[unit]
    if not 1e6 <= value <= 1e15:
        raise ValueError(f"{flag} {text!r}: must be between 1 MB/s and 1 PB/s")
    return value


# A rank's host memory cap (--mem-cap-gib): at most a host far larger than any made.
MAX_MEM_CAP_GIB = 2**16  # 64 TiB


# A run's options. Device is where cells compute; a Surface is a parser that takes run options:
# the CLI (`python -m harness run`), the suites' pytest plugin (suites/conftest.py), or the
# worker every rank runs (harness/runner/worker.py).
Device = Literal["cpu", "cuda"]
Surface = Literal["cli", "pytest", "worker"]
GIB = 2**30
# The most cells a run selects unless told otherwise (--max-cells): 7× the full suite, hours of
# CPU cells; 10⁴ cells take tens of seconds to build and check before the first one runs.
DEFAULT_MAX_CELLS = 2000


@dataclass(frozen=True, kw_only=True)
class OptionFlag:
    """How a RunOptions field is typed on a command line; every surface's parser is built from these."""

    name: str  # "--cell-timeout", "-m"
    help: str  # "{suites}" stands for the named suites
    type: Callable[[str], object] = str  # bool: a switch
    choices: tuple[str, ...] | None = None
    # The CLI's name for the value where the flag's own is not it (-m MARKEXPR); the pytest
    # plugin names every value after its flag (--suite=SUITE), choices name themselves.
    metavar: str | None = None
    surfaces: frozenset[Surface] = frozenset({"cli", "pytest"})
    # -m and -k are pytest's own options: the plugin reads them (by this dest) and adds none.
    pytest_dest: str | None = None
    # The plugin's help where pytest reads the option otherwise than the CLI: pytest reads no
    # SLURM variables (the CLI resolves them and passes the result) and resumes a run folder.
    pytest_help: str | None = None

    def dest(self, surface: Surface, field_name: str) -> str:
        """Where ``surface``'s parser puts the value."""
        return self.pytest_dest if surface == "pytest" and self.pytest_dest else field_name


def _option(default: object, **flag: Any) -> Any:
    """A RunOptions field and its flag."""
    return field(default=default, metadata={"flag": OptionFlag(**flag)})


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """A run's options, declared once: the CLI, the pytest plugin and the worker build their
    parsers from the fields' flags (``add_run_options``) and read what was given back with
    ``from_args``; ``to_args`` hands the options on (the CLI to pytest, the launcher, which holds
    them in LaunchOptions.run, to every rank). None is "not given": a resumed run takes its own
    selection, the node options their SLURM values. The node options are checked once resolved
    (runner/nodes.py, NodeSpec)."""

    suite: str = _option("default", name="--suite",
                         help="one of {suites} (default: default), or a .toml suite file (README: Suites of your own)")
    # Carried to pytest and the workers by harness.distributed's environment variable.
    device: Device | None = _option(None, name="--device", choices=get_args(Device), surfaces=frozenset({"cli"}),
                                    help="run cells on cpu (gloo) or cuda (NCCL); default: cuda where a GPU is visible")
    gpus: int | None = _option(
        None, name="--gpus", type=int,
        help="ranks per node: GPUs, or CPU processes where there are none (default: all GPUs, else 2)")
    marker_expression: str = _option("", name="-m", metavar="MARKEXPR", pytest_dest="markexpr",
                                     help='pytest marker expression, e.g. "fsdp and bf16"')
    keyword_expression: str = _option("", name="-k", metavar="KEYWORD", pytest_dest="keyword",
                                      help="pytest keyword expression on cell ids")
    out: Path | None = _option(None, name="--out", type=Path,
                               help="folder for results/ and reports/ (default: the repo)")
    cell_timeout_s: float | None = _option(
        None, name="--cell-timeout", type=float,
        help="seconds without progress before a cell is declared hung (default: scaled to each cell, README Faults)")
    # Every rank reads it: CUDA caps the allocator, CPU ranks compare their peak (worker.py).
    mem_cap_gib: float | None = _option(
        None, name="--mem-cap-gib", type=float, surfaces=frozenset({"cli", "pytest", "worker"}),
        help="memory per rank, as if each had a device this size: a rank over it records oom with its peak"
             " (README Faults)")
    repeat: int | None = _option(None, name="--repeat", type=int,
                                 help="trials per cell, in rounds over every cell (default 1; with --resume: the run's"
                                      " own; README Repeated runs)")
    memory_snapshot: bool = _option(
        False, name="--memory-snapshot", type=bool,
        help="write each cell's memory-over-time by category (and on CUDA the allocator's snapshot for"
             " pytorch.org/memory_viz) to the run folder's memory/; charted in the cell's page")
    profile: bool = _option(
        False, name="--profile", type=bool,
        help="trace each cell's timed steps with torch.profiler (Chrome trace JSON per rank in the run folder's"
             " profiles/, for Perfetto or TensorBoard; linked from the cell's page); slows the steps it traces")
    nnodes: int | None = _option(
        None, name="--nnodes", type=int,
        help="nodes in the job, one launcher per node (default 1, or SLURM_NNODES); README Several nodes",
        pytest_help="nodes in the job (one launcher per node; default 1)")
    node_rank: int | None = _option(
        None, name="--node-rank", type=int,
        help="this node's rank in [0, nnodes) (or SLURM_NODEID); only node 0 writes results/",
        pytest_help="this node's rank in [0, nnodes); only node 0 runs under pytest (the others: python -m harness"
                    " run)")
    master_addr: str | None = _option(
        None, name="--master-addr",
        help="node 0's address, the c10d rendezvous endpoint (or SLURM_JOB_NODELIST's first host)",
        pytest_help="node 0's address: the c10d rendezvous endpoint's host")
    master_port: int | None = _option(None, name="--master-port", type=int,
                                      help="the rendezvous endpoint's port (default MASTER_PORT, else 29500)",
                                      pytest_help="the rendezvous endpoint's port (default 29500)")
    # A run id, 'latest' or a run folder; the CLI resolves it to the folder it hands pytest.
    resume: str | None = _option(
        None, name="--resume", metavar="RUN_ID",
        help="run the cells of run RUN_ID (id under results/, 'latest', or a run folder) that have no record yet,"
             " into the same run; the selection is the run's own",
        pytest_help="run folder to resume: run only its cells without a kept record, appending to it")
    retry_failed: bool = _option(False, name="--retry-failed", type=bool,
                                 help="with --resume: also re-run cells recorded failed, timeout or oom")
    # The GPU matrix (harness/suites_gpu.py) and the fit check (harness/predict/fit.py) size for it.
    gpu_mem: str | None = _option(
        None, name="--gpu-mem",
        help="memory per GPU to size the default suite's real-size matrix and its fit checks for, e.g. 80GiB"
             " (default: the GPU's own); with --device cuda and --gpus, `list` shows a GPU node's matrix anywhere")
    launch_anyway: bool = _option(False, name="--launch-anyway", type=bool,
                                  help="launch cells predicted not to fit the GPU (recorded does_not_fit otherwise)")
    max_cells: int = _option(
        DEFAULT_MAX_CELLS, name="--max-cells", type=int, surfaces=frozenset({"cli"}),
        help=f"refuse a selection of more cells than this, counted before any is built (default {DEFAULT_MAX_CELLS:,}:"
             " a suite file's product of axes that large is usually a mistake)")
    # Both skip work done once per run before the cells (seconds for a few cells, minutes for
    # the default suite's trace): for iterating on a cell, and for the harness's own tests.
    no_bandwidth: bool = _option(False, name="--no-bandwidth", type=bool,
                                 help="skip the collective bandwidth sweep before the cells (run.json says so)")
    no_trace: bool = _option(False, name="--no-trace", type=bool,
                             help="skip tracing each cell's peak under FakeTensorMode before it runs (its record"
                                  " says so; the analytic prediction stays)")

    def __post_init__(self) -> None:
        self._check(self.device is None or self.device in get_args(Device), "device",
                    f"choose one of {', '.join(get_args(Device))}")
        self._check(self.gpus is None or 1 <= self.gpus <= MAX_COUNT, "gpus",
                    f"must be a positive number of ranks per node, at most {MAX_COUNT:,}")
        self._check(self.cell_timeout_s is None or 0 < self.cell_timeout_s < float("inf"), "cell_timeout_s",
                    "must be a positive, finite number of seconds")
        self._check(self.mem_cap_gib is None or 0 < self.mem_cap_gib <= MAX_MEM_CAP_GIB, "mem_cap_gib",
                    f"must be a positive number of GiB per rank, at most {MAX_MEM_CAP_GIB}")
        self._check(self.repeat is None or 1 <= self.repeat <= MAX_COUNT, "repeat",
                    f"must be 1 or more trials per cell, at most {MAX_COUNT:,}")
        self._check(1 <= self.max_cells <= MAX_COUNT, "max_cells", f"must be 1 or more cells, at most {MAX_COUNT:,}")
        if self.gpu_mem is not None:
            parse_bytes(self.gpu_mem)  # ValueError, one line, for a size it cannot read
        if self.retry_failed and self.resume is None:
            raise ValueError("--retry-failed: only with --resume RUN_ID")

    def _check(self, ok: bool, field_name: str, allowed: str) -> None:
        # Named as the user typed it: options come from flags (`--gpus 0: must be ...`).
        if not ok:
            raise ValueError(f"{_FLAGS[field_name].name} {getattr(self, field_name)}: {allowed}")

    @property
    def gpu_mem_bytes(self) -> int | None:
        return None if self.gpu_mem is None else int(parse_bytes(self.gpu_mem))

    @property
    def mem_cap_bytes(self) -> int | None:
        """The memory cap as run.json, node 0's plan and the worker's checks keep it."""
        return None if self.mem_cap_gib is None else int(self.mem_cap_gib * GIB)

    @classmethod
    def given(cls, args: object, surface: Surface) -> dict[str, Any]:
        """The options given to ``surface``'s parser (``args``: its namespace; None: not given), by field."""
        return {name: value for name, flag in _flags_of(surface)
                if (value := getattr(args, flag.dest(surface, name), None)) is not None}

    @classmethod
    def from_args(cls, args: object, surface: Surface) -> RunOptions:
        """The options given to ``surface``'s parser, the defaults for the rest."""
        return cls(**cls.given(args, surface))

    def to_args(self, surface: Surface) -> list[str]:
        """The command-line arguments that give ``surface`` these options (those not at their default)."""
        out: list[str] = []
        for name, flag in _flags_of(surface):
            value = getattr(self, name)
            if value != _DEFAULTS[name]:
                out += [flag.name] if flag.type is bool else [flag.name, str(value)]
        return out


_FLAGS: dict[str, OptionFlag] = {f.name: f.metadata["flag"] for f in dataclasses.fields(RunOptions)}
_DEFAULTS: dict[str, object] = {f.name: f.default for f in dataclasses.fields(RunOptions)}


def _flags_of(surface: Surface) -> Iterator[tuple[str, OptionFlag]]:
    return ((name, flag) for name, flag in _FLAGS.items() if surface in flag.surfaces)


def add_run_options(add_argument: Callable[..., object], surface: Surface, only: Iterable[str] | None = None,
                    suite_names: Iterable[str] = ()) -> None:
    """Add RunOptions' flags for ``surface`` (``only`` those fields, where given) through
    ``add_argument``: argparse's ``add_argument`` or pytest's ``addoption``, which take the same
    arguments. Every default is None, "not given": RunOptions holds the defaults."""
    wanted = set(_FLAGS) if only is None else set(only)
    for name, flag in _flags_of(surface):
        if name not in wanted or (surface == "pytest" and flag.pytest_dest):
            continue
        help_text = flag.pytest_help if surface == "pytest" and flag.pytest_help else flag.help
        add_argument(flag.name, dest=name, default=None, help=help_text.format(suites=", ".join(suite_names)),
                     **_value_arguments(flag, surface))


def _value_arguments(flag: OptionFlag, surface: Surface) -> dict[str, Any]:
    """What the parser needs to know of the flag's value."""
    if flag.type is bool:
        return {"action": "store_true"}
    if flag.choices is not None:
        return {"type": flag.type, "choices": flag.choices}
    named = flag.metavar if surface != "pytest" and flag.metavar else flag.name.lstrip("-").replace("-", "_").upper()
    return {"type": flag.type, "metavar": named}


def gib_of(n_bytes: int | None) -> float | None:
    """A memory cap kept in bytes (run.json, node 0's plan) as RunOptions.mem_cap_gib: exact,
    since a power of two divides it."""
    return None if n_bytes is None else n_bytes / GIB
