"""The default suite on GPUs: real models at real sizes, for the GPUs present (their count
and memory), where the CPU default trains 2-layer toys.

Models: gpt2-124m (at 1024 tokens, its position table's length) and llama-1b (2048 tokens)
on any GPU count; llama3-8b (2048 tokens) from ``LARGE_MODEL_GPUS`` GPUs of at least
``LARGE_MODEL_GPU_BYTES`` each. bf16 throughout, with fp32 and fp16 on gpt2-124m where they
say something (DDP, FSDP2).

One GPU: the single-process trainings a one-GPU user chooses among (precision,
checkpointing, an 8-bit optimizer) and the offloads that let one GPU hold more (FSDP2's
parameter offload, DeepSpeed ZeRO-Offload), each at world size 1. Several: DDP, the ZeRO
stages of torch, DeepSpeed and FairScale, FSDP2 and FSDP1 modes, offload, checkpointing,
accumulation, compression, and tensor and pipeline parallelism on llama-1b.

The batch rule, so that every strategy of a model trains the same global batch and is gated
against one reference: the global batch G is the largest power of two from the world size up
to ``MAX_PER_RANK`` × world size whose single-process reference (G samples in one step) is
predicted to fit one GPU (harness/predict/fit.py); each cell then takes the largest
micro-batch that divides its share of G and is predicted to fit, accumulating the rest. A
cell that fits at no micro-batch keeps micro-batch 1 and is recorded ``does_not_fit`` at run
time, with the predicted and available bytes. Where even G = world size does not fit one GPU
(llama3-8b: 16 bytes of states per parameter is 128 GB; llama-1b's 8 samples of 2048 tokens
on a 40 GB GPU) the reference is recorded ``does_not_fit`` and its cells are measured
ungated (their equivalence says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness import distributed, strategies
from harness.config import CellSpec, StrategySpec
from harness.predict import fit
from harness.suite_cell import suite_cell

LARGE_MODEL_GPUS = 8
LARGE_MODEL_GPU_BYTES = 80 * 10**9  # "80 GB" as sold: an H100 or A100 80GB reports about 79.2 GiB, 85e9 bytes
MAX_PER_RANK = 8
STEPS = 10


@dataclass(frozen=True, kw_only=True)
class GpuTarget:
    """The GPUs a matrix is for: memory per GPU (the device's own, or --gpu-mem) and name."""

    memory_bytes: int
    name: str | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"GPU memory {self.memory_bytes}: must be positive")


def target(memory_bytes: int | None) -> GpuTarget | None:
    """The GPUs the selection is for: None off CUDA; else ``memory_bytes`` (--gpu-mem) or the
    memory and name of this host's first GPU."""
    if distributed.selected_device() != "cuda":
        return None
    if memory_bytes is not None:
        return GpuTarget(memory_bytes=memory_bytes)
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU is visible here; give --gpu-mem (e.g. 80GiB) and --gpus to list"
                         " a GPU node's matrix")
    return GpuTarget(memory_bytes=torch.cuda.get_device_properties(0).total_memory, name=torch.cuda.get_device_name(0))


def models_for(world_size: int, gpu: GpuTarget) -> list[tuple[str, int]]:
    """(preset, seq_len) of the models this many GPUs of this memory train."""
    chosen = [("gpt2-124m", 1024), ("llama-1b", 2048)]
    if world_size >= LARGE_MODEL_GPUS and gpu.memory_bytes >= LARGE_MODEL_GPU_BYTES:
        chosen.append(("llama3-8b", 2048))
    return chosen


def _variants(model: str, world_size: int) -> list[dict[str, Any]]:
    """The strategy options of the model's cells, before the batch rule sizes them."""
    if world_size == 1:
        out: list[dict[str, Any]] = [{"name": "single", "precision": p} for p in ("bf16", "fp32", "fp16")]
        out += [{"name": "single", "precision": "bf16", "checkpointing": c} for c in ("full", "selective")]
        out += [{"name": "single", "precision": "bf16", "optimizer": "adamw8bit"},
                {"name": "fsdp_full", "precision": "bf16", "offload": "params"},
                {"name": "deepspeed_zero3", "precision": "bf16", "offload": "optimizer"},
                {"name": "deepspeed_zero3", "precision": "bf16", "offload": "optimizer_params"}]
        return out
    sharding = ("ddp", "zero1", "fsdp_grad_op", "fsdp_full", "fsdp1_grad_op", "fsdp1_full",
                "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "fairscale_oss", "fairscale_sdp",
                "fairscale_fsdp")
    out = [{"name": s, "precision": "bf16"} for s in sharding]
    out += [{"name": s, "precision": "bf16", "checkpointing": "full"} for s in ("ddp", "fsdp_full", "deepspeed_zero3")]
    out += [{"name": "fsdp_full", "precision": "bf16", "checkpointing": "selective"},
            {"name": "fsdp_full", "precision": "bf16", "offload": "params"},
            {"name": "deepspeed_zero2", "precision": "bf16", "offload": "optimizer"},
            {"name": "deepspeed_zero3", "precision": "bf16", "offload": "optimizer_params"},
            {"name": "ddp", "precision": "bf16", "accumulation": 4},
            {"name": "fsdp_full", "precision": "bf16", "accumulation": 4}]
    if model == "gpt2-124m":
        out += [{"name": s, "precision": p} for s in ("ddp", "fsdp_full") for p in ("fp32", "fp16")]
        # DataParallel beside DDP over the same GPUs (one process driving all of them).
        out += [{"name": "dataparallel", "precision": "bf16"}]
        out += [{"name": "ddp", "precision": "bf16", "compression": "bf16"},
                {"name": "ddp", "precision": "bf16", "compression": "powersgd", "powersgd_rank": 4},
                {"name": "ddp", "precision": "bf16", "optimizer": "adamw8bit"}]
    if model == "llama-1b":
        out += [{"name": s, "precision": "bf16"} for s in ("tp", "tp_fsdp", "pp_1f1b", "pp_interleaved_1f1b")]
    return out


def _make(model: str, seq_len: int, world_size: int, micro_batch: int, **strategy: Any) -> CellSpec | None:
    """The cell, or None where these options do not form one at this world size."""
    try:
        cell = suite_cell(model, StrategySpec(**strategy), 1 if strategy["name"] == "single" else world_size,
                          micro_batch=micro_batch, seq_len=seq_len, steps=STEPS)
    except ValueError:
        return None
    return cell if strategies.incompatibility(cell) is None else None


def _fits(cell: CellSpec, gpu: GpuTarget) -> bool:
    checked = fit.check(cell, gpu.memory_bytes)
    return checked is None or checked.fits


def global_batch(model: str, seq_len: int, world_size: int, gpu: GpuTarget) -> int:
    """The largest power of two G in [world size, MAX_PER_RANK × world size] whose reference
    (G samples in one process, one step) is predicted to fit one GPU; the world size if none."""
    best = world_size
    g = world_size
    while g <= MAX_PER_RANK * world_size:
        reference = _make(model, seq_len, world_size, g, name="single", precision="bf16")
        if reference is not None and _fits(reference, gpu):
            best = g
        g *= 2
    return best


def cells(world_size: int, gpu: GpuTarget) -> list[CellSpec]:
    """The matrix for ``world_size`` GPUs of ``gpu``'s memory (references are added by the run)."""
    out: list[CellSpec] = []
    for model, seq_len in models_for(world_size, gpu):
        batch = global_batch(model, seq_len, world_size, gpu)
        for options in _variants(model, world_size):
            cell = _make(model, seq_len, world_size, 1, **options)
            if cell is not None and (cell := fit.sized(cell, batch, lambda c: _fits(c, gpu))) is not None:
                out.append(cell)
    return out
