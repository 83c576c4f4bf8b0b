"""Parameter offload to host memory, as each FSDP generation spells it."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy


def fsdp2_policy(offload: str, device: torch.device) -> OffloadPolicy:
    # Pinned host buffers make the host<->device copies asynchronous on a GPU; without an
    # accelerator, pinning fails.
    if offload == "params":
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def fsdp1_config(offload: str) -> CPUOffload:
    return CPUOffload(offload_params=offload == "params")
