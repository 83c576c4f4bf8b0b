"""The optimizer axis: which update rule every rank (and the single-process reference) runs.

- ``adamw``: torch.optim.AdamW with its defaults and the cell's lr.
- ``adam8bit`` / ``adamw8bit``: bitsandbytes' block-wise 8-bit Adam / AdamW (state as uint8
  codes plus one fp32 absmax per 256-value block; tensors under 4096 elements keep 32-bit
  state, bitsandbytes' ``min_8bit_size``). About 0.5× the parameter bytes of state where
  AdamW holds 2×.
- ``paged_adamw8bit``: bitsandbytes' PagedAdamW8bit, whose state lives in CUDA unified
  memory. On CPU bitsandbytes falls back to the non-paged optimizer (it warns
  "Paged optimizers are not supported on CPU. Falling back to non-paged optimizer behavior."
  at the first step), so a CPU cell would measure ``adamw8bit`` under another name:
  ``unsupported_reason`` refuses it there instead.
- ``adafactor``: torch.optim.Adafactor (factored second moment: row and column statistics
  for matrices, no first moment) with its defaults and the cell's lr.
- ``lamb`` / ``lamb8bit``: bitsandbytes' LAMB (You et al. 2020: Adam's moments with a
  layer-wise trust ratio, the norm of each tensor's weights over its update's) with 32-bit and
  block-wise 8-bit state, and one fp32 update norm per tensor. The trust ratio is a per-tensor
  norm, so an engine that hands the optimizer flat shards (FSDP1, DeepSpeed ZeRO) or DTensor
  shards (FSDP2) computes another update: only the strategies that step whole tensors take it.
- ``fused_lamb``: DeepSpeed's FusedLamb (``deepspeed.ops.lamb``: LAMB's two fp32 moments and
  trust ratio in one CUDA kernel over the parameter list, its coefficient clamped to
  [0.01, 10]) with its defaults and the cell's lr, handed to whichever engine steps whole
  tensors (the reference too). A CUDA op only: on the CPU its constructor, loading the op,
  raises "This op had not been implemented on CPU backend.", so ``unsupported_reason``
  refuses it there.
- ``sgd``: torch.optim.SGD with heavy-ball momentum ``SGD_MOMENTUM`` (0.9, the value of the
  ResNet and transformer recipes that use SGD) and the cell's lr: one fp32 momentum buffer per
  parameter, 4 B per parameter of state where AdamW holds 8.

One definition, so that a sharded optimizer and the single-process reference run the same
update rule and the equivalence gate compares like with like (the reference cell uses the
same optimizer: CellSpec.reference). Wrappers that construct the optimizer themselves
(ZeroRedundancyOptimizer, FairScale OSS) take ``optimizer_class_and_kwargs``.

bitsandbytes is imported on use: it takes seconds and prints about kernels it cannot load.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import ParamsT  # parameters, or parameter groups (tensor parallel's)

NAMES = ("adamw", "adam8bit", "adamw8bit", "paged_adamw8bit", "adafactor", "sgd", "lamb", "lamb8bit", "fused_lamb")
SGD_MOMENTUM = 0.9
BITSANDBYTES = frozenset({"adam8bit", "adamw8bit", "paged_adamw8bit", "lamb", "lamb8bit"})
# Optimizers whose update uses each tensor's norm (LAMB's trust ratio): refused where the
# optimizer sees shards instead of whole tensors.
PER_TENSOR_NORM = frozenset({"lamb", "lamb8bit", "fused_lamb"})
# Optimizers whose step is a CUDA kernel with no CPU path at all (not even a slow one).
CUDA_KERNEL_ONLY = frozenset({"fused_lamb"})
PER_TENSOR_NORM_NOTE = ("LAMB's trust ratio is each tensor's weight norm over its update's: on the shards this engine"
                        " hands the optimizer it would be the shard's, a different update than the reference's")

PAGED_ON_CPU = (
    "bitsandbytes paged optimizers need CUDA unified memory: on CPU PagedAdamW8bit falls back"
    " to the non-paged optimizer ('Paged optimizers are not supported on CPU. Falling back to"
    " non-paged optimizer behavior.'), so the cell would measure adamw8bit under another name"
)

FUSED_LAMB_ON_CPU = ("DeepSpeed's FusedLamb is a CUDA kernel: on the CPU loading it raises 'This op had not been"
                     " implemented on CPU backend.'")


def optimizer_class_and_kwargs(name: str, lr: float) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and its keyword arguments (all defaults but lr; SGD's momentum)."""
    if name == "adamw":
        return torch.optim.AdamW, {"lr": lr}
    if name == "adafactor":
        return torch.optim.Adafactor, {"lr": lr}
    if name == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": SGD_MOMENTUM}
    if name in BITSANDBYTES:
        import bitsandbytes.optim as bnb_optim

        cls = {"adam8bit": bnb_optim.Adam8bit, "adamw8bit": bnb_optim.AdamW8bit,
               "paged_adamw8bit": bnb_optim.PagedAdamW8bit, "lamb": bnb_optim.LAMB,
               "lamb8bit": bnb_optim.LAMB8bit}[name]
        return cls, {"lr": lr}
    if name == "fused_lamb":
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb, {"lr": lr}
    raise ValueError(f"optimizer={name!r}: choose one of {', '.join(NAMES)}")


def make(params: ParamsT, name: str, lr: float) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_class_and_kwargs(name, lr)
    return cls(params, **kwargs)


def unsupported_reason(name: str, device_type: str) -> str | None:
    """Why this hardware cannot run optimizer ``name`` as itself, or None."""
    if name == "paged_adamw8bit" and device_type != "cuda":
        return PAGED_ON_CPU
    if name in CUDA_KERNEL_ONLY and device_type != "cuda":
        return FUSED_LAMB_ON_CPU
    return None
