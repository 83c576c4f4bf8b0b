"""The process group a worker lives in, and the device meshes built on it (cached: one
process group serves many cells, and re-creating groups inside a long-lived worker hangs)."""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

DEVICE_ENV_VAR = "SHARDBENCH_DEVICE"
DEVICES = ("cpu", "cuda")  # config.Device names the same two (config is a layer above)


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    rank: int
    world_size: int
    nnodes: int
    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def selected_device() -> str:
    """The device the cells are for: SHARDBENCH_DEVICE (cpu | cuda) if set, else CUDA where a
    GPU is visible and the CPU elsewhere. Not checked against this host: ``list --device cuda``
    shows a GPU node's matrix on any machine."""
    chosen = os.environ.get(DEVICE_ENV_VAR, "")
    if chosen and chosen not in DEVICES:
        raise ValueError(f"{DEVICE_ENV_VAR}={chosen!r}: choose one of {', '.join(DEVICES)}")
    return chosen or ("cuda" if torch.cuda.is_available() else "cpu")


def job_world_size(gpus: int | None, nnodes: int = 1) -> int:
    """Ranks in the job: nodes × ranks per node (``gpus``: every GPU, or 2 CPU processes)."""
    if gpus is not None:
        return gpus * nnodes
    if selected_device() != "cuda":
        return 2 * nnodes
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU is visible here; give --gpus N (and --gpu-mem) to list the"
                         " matrix of a node of N GPUs")
    return nnodes * torch.cuda.device_count()


def device_type() -> str:
    """Where cells run (``selected_device``), which must be on this host. Forcing "cpu" on a
    GPU host runs gloo ranks on the CPU (the harness's own tests do, so they pass on any host)."""
    chosen = selected_device()
    if chosen == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{DEVICE_ENV_VAR}=cuda: no CUDA device is visible on this host")
    return chosen


def init_from_torchrun() -> DistEnv:
    """Join the process group torchrun describes in the environment (gloo on CPU, NCCL on GPU)."""
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    if device_type() == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return DistEnv(
        rank=dist.get_rank(),
        world_size=world_size,
        nnodes=world_size // local_world,
        device=device,
        backend=backend,
    )


@functools.cache
def mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def hsdp_shape(env: DistEnv) -> tuple[int, int]:
    """(replicate, shard) for hybrid sharding: shard within a node, replicate across nodes.

    On one node that leaves a replicate degree of 1; with four or more ranks on one node the
    ranks are split in two replicas so that both mesh dimensions do real work.
    """
    if env.nnodes > 1:
        return env.nnodes, env.world_size // env.nnodes
    if env.world_size >= 4 and env.world_size % 2 == 0:
        return 2, env.world_size // 2
    return 1, env.world_size


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor, without importing torch.distributed.tensor (0.6 s of
    every process's start here): no DTensor exists until a strategy that makes them has
    imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)
