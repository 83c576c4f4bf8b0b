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
from typing import Literal, get_args

Precision = Literal["fp32", "bf16", "fp16"]
Checkpointing = Literal["none", "full", "selective"]
Offload = Literal["none", "params", "optimizer", "optimizer_params"]
Optimizer = Literal["adamw", "adam8bit", "adamw8bit", "paged_adamw8bit", "adafactor"]
Compression = Literal["none", "fp16", "bf16", "powersgd"]
HsdpMesh = Literal["explicit", "fsdp_default"]

# PowerSGD runs vanilla all-reduce for its first steps (start_powerSGD_iter; 2 is the smallest
# value it accepts) and allocates its error-feedback state in the first compressed step:
# a PowerSGD cell's warm-up must include that step, or the memory step measures a one-off.
POWERSGD_START_ITER = 2
MIN_WARMUP = 2

STRATEGY_NAMES = (
    "single",
    "ddp",
    "zero1",
    "fsdp_full",
    "fsdp_grad_op",
    "fsdp_hybrid",
    "fsdp1_full",
    "fsdp1_grad_op",
    "fsdp1_no_shard",
    "fsdp1_hybrid",
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero3",
    "fairscale_oss",
    "fairscale_sdp",
    "fairscale_fsdp",
)


def _check_choice(field_name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        choices = ", ".join(str(a) for a in allowed)
        raise ValueError(f"{field_name}={value!r}: choose one of {choices}")


def min_warmup(strategy: StrategySpec) -> int:
    """Steps before a strategy's steps are all alike (the default warm-up)."""
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

    def __post_init__(self) -> None:
        _check_choice("strategy", self.name, STRATEGY_NAMES)
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
        if self.hsdp_mesh != "explicit" and self.name != "fsdp1_hybrid":
            raise ValueError(f"hsdp_mesh={self.hsdp_mesh!r}: applies to strategy=fsdp1_hybrid only")


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
    # Steps after warm-up: one memory-tracked, one communication-counted, the rest timed.
    # (Both probes add overhead, so they never share a step with the timer.)
    probe_steps: int = field(default=2, init=False)

    def __post_init__(self) -> None:
        from harness.models.presets import PRESETS  # pulls in transformers: import on use

        _check_choice("model", self.model, tuple(PRESETS))
        for name in ("micro_batch", "world_size", "steps"):
            _check_positive(name, getattr(self, name))
        least = min_warmup(self.strategy)
        if self.warmup is None:
            object.__setattr__(self, "warmup", least)  # frozen: set once, here
        if self.warmup < least:
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
        if self.strategy.name == "single" and self.world_size != 1:
            raise ValueError("strategy=single is the one-process reference: world_size must be 1")

    @property
    def min_steps(self) -> int:
        """The fewest steps this cell accepts: warm-up, the probes and 2 timed steps."""
        return self.warmup + self.probe_steps + 2

    @property
    def timed_steps(self) -> int:
        return self.steps - self.warmup - self.probe_steps

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, over all ranks and accumulation micro-steps."""
        return self.micro_batch * self.world_size * self.strategy.accumulation

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
        parts += [f"mb{self.micro_batch}", f"ws{self.world_size}", f"seed{self.seed}"]
        return "/".join(parts)

    def reference(self) -> CellSpec:
        """The single-process run this cell must train identically to.

        Same model, seed, precision, optimizer, data and steps; the whole global batch in one
        process and one micro-step, no feature that should not change the maths
        (checkpointing, offload, compression, accumulation).
        """
        return dataclasses.replace(
            self,
            strategy=StrategySpec(name="single", precision=self.strategy.precision,
                                  optimizer=self.strategy.optimizer),
            micro_batch=self.global_batch,
            world_size=1,
            warmup=None,  # its own: the warm-up decides which steps are measured, not the losses
        )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("probe_steps")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CellSpec:
        d = dict(d)
        d["strategy"] = StrategySpec(**d["strategy"])
        return cls(**d)
