"""Parameter offload to host memory, as each FSDP generation spells it."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy


def fsdp2_policy(offload: str) -> OffloadPolicy:
    # pin_memory needs an accelerator; on a CPU-only host pinning fails, and on a GPU host
    # pinned buffers are what make the host<->device copies asynchronous.
    if offload == "params":
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return OffloadPolicy()


def fsdp1_config(offload: str) -> CPUOffload:
    return CPUOffload(offload_params=offload == "params")
