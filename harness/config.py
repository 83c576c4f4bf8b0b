"""What a cell is: the frozen, validated description of one benchmark measurement.

A cell = (model, strategy with its feature options, micro-batch, world size, steps, seed).
Everything here is pure data: it imports no torch, serialises to JSON as it is, and refuses
bad values in ``__post_init__`` with a message that names the allowed values. Whether a
strategy *can* combine with a feature is the strategy's business (harness/strategies/);
whether this machine can run it is decided at launch (``unsupported`` is a result).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from harness import strategies
from harness.features.compression import POWERSGD_START_ITER
from harness.models.presets import PRESETS
from harness.strategies.base import LayoutOption

Precision = Literal["fp32", "bf16", "fp16"]
Checkpointing = Literal["none", "full", "selective"]
Offload = Literal["none", "params", "optimizer", "optimizer_params"]
Optimizer = Literal["adamw", "adam8bit", "adamw8bit", "paged_adamw8bit", "adafactor"]
Compression = Literal["none", "fp16", "bf16", "powersgd"]
HsdpMesh = Literal["explicit", "fsdp_default"]
# transformers' attn_implementation: "eager" materialises the attention scores, "sdpa"
# calls torch's scaled_dot_product_attention (a fused kernel where the device has one),
# "flash" is flash_attention_2 (the flash-attn package, CUDA only).
Attention = Literal["sdpa", "eager", "flash"]

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


def _check_positive(field_name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{field_name}={value!r}: must be a positive integer")


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """A parallel strategy and the feature options applied with it."""

    name: str
    precision: Precision = "fp32"
    checkpointing: Checkpointing = "none"
    # What lives in host memory: parameters, optimizer state, or both.
    offload: Offload = "none"
    optimizer: Optimizer = "adamw"
    accumulation: int = 1
    compression: Compression = "none"
    # PowerSGD's matrix approximation rank (only read when compression == "powersgd").
    powersgd_rank: int = 1
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
    # Pipelines (and megatron with pp_degree > 1): the micro-batches one optimizer step is cut
    # into (each of cell.micro_batch samples).
    pp_microbatches: int | None = None

    def __post_init__(self) -> None:
        declared = strategies.get(self.name)  # an unknown name is refused, naming the choices
        _check_choice("precision", self.precision, get_args(Precision))
        _check_choice("checkpointing", self.checkpointing, get_args(Checkpointing))
        _check_choice("offload", self.offload, get_args(Offload))
        _check_choice("optimizer", self.optimizer, get_args(Optimizer))
        _check_choice("compression", self.compression, get_args(Compression))
        _check_choice("hsdp_mesh", self.hsdp_mesh, get_args(HsdpMesh))
        _check_positive("accumulation", self.accumulation)
        _check_positive("powersgd_rank", self.powersgd_rank)
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

    model: str
    strategy: StrategySpec
    micro_batch: int = 2
    world_size: int = 2
    steps: int = 10
    # None: the fewest steps after which this strategy's steps are steady (min_warmup).
    warmup: int | None = None
    seed: int = 0
    lr: float = 1e-3
    # Model structure axes: the attention implementation, and (CUDA) the caching allocator's
    # expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).
    attention: Attention = "sdpa"
    expandable_segments: bool = False
    # Steps after warm-up: one memory-tracked, one communication-counted, the rest timed.
    # (Both probes add overhead, so they never share a step with the timer.)
    probe_steps: int = field(default=2, init=False)

    def __post_init__(self) -> None:
        _check_choice("model", self.model, tuple(PRESETS))
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
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r}: must be positive")
        if self.strategy.name == REFERENCE and self.world_size != 1:
            raise ValueError(f"strategy={REFERENCE} is the one-process reference: world_size must be 1")
        _check_choice("attention", self.attention, get_args(Attention))
        if self.attention != "sdpa" and PRESETS[self.model].family == "mlp":
            raise ValueError(f"attention={self.attention!r}: model {self.model} has no attention; leave it 'sdpa'")
        if self.attention == "flash" and self.strategy.precision == "fp32":
            raise ValueError("attention='flash' with precision=fp32: flash-attn computes in fp16 or bf16 only;"
                             " choose precision bf16 or fp16")
        if not isinstance(self.expandable_segments, bool):
            raise ValueError(f"expandable_segments={self.expandable_segments!r}: must be true or false")
        s = self.strategy
        if problem := strategies.get(s.name).layout_problem(self):
            raise ValueError(problem)
        if s.pipelined and s.accumulation != 1:
            raise ValueError(f"accumulation={s.accumulation} with {s.name}: a pipeline accumulates over its own"
                             " micro-batches; set pp_microbatches instead")

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
        parts = [self.model, s.name, s.precision, f"ckpt_{s.checkpointing}"]
        if s.offload != "none":
            parts.append(f"offload_{s.offload}")
        if s.optimizer != "adamw":
            parts.append(s.optimizer)
        if s.accumulation != 1:
            parts.append(f"accum{s.accumulation}")
        if s.compression != "none":
            rank = f"-r{s.powersgd_rank}" if s.compression == "powersgd" else ""
            parts.append(f"compress_{s.compression}{rank}")
        if s.hsdp_mesh != "explicit":
            parts.append(f"mesh_{s.hsdp_mesh}")
        # The layout options are None wherever they do not apply (StrategySpec._resolve).
        parts += [f"{tag}{value}" for tag, value in (("tp", s.tp_degree), ("pp", s.pp_degree),
                                                     ("pmb", s.pp_microbatches)) if value is not None]
        if self.attention != "sdpa":
            parts.append(f"attn_{self.attention}")
        if self.expandable_segments:
            parts.append("alloc_expandable")
        parts += [f"mb{self.micro_batch}", f"ws{self.world_size}", f"seed{self.seed}"]
        return "/".join(parts)

    def reference(self) -> CellSpec:
        """The single-process run this cell must train identically to.

        Same model, attention, seed, precision, optimizer, data and steps; the whole global
        batch in one process and one micro-step, no feature that should not change the maths
        (checkpointing, offload, compression, accumulation, the allocator's settings).
        """
        return dataclasses.replace(
            self,
            strategy=StrategySpec(name=REFERENCE, precision=self.strategy.precision,
                                  optimizer=self.strategy.optimizer),
            micro_batch=self.global_batch,
            world_size=1,
            warmup=None,  # its own: the warm-up decides which steps are measured, not the losses
            expandable_segments=False,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("probe_steps")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CellSpec:
        d = dict(d)
        d["strategy"] = StrategySpec(**d["strategy"])
        return cls(**d)
