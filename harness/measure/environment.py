"""The environment recorded with every run: hardware, the interconnect, library versions, git
state, and the variables that change how collectives and the allocator behave (NCCL_* among
them: the transports NCCL may use, NCCL_IB_*, NCCL_P2P_*, NCCL_SOCKET_IFNAME, …)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import torch

LIBRARIES = ("torch", "transformers", "numpy", "pandas", "deepspeed", "fairscale", "bitsandbytes")
ENV_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_", "CUDA_", "OMP_", "GLOO_", "MASTER_", "SHARDBENCH_")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_driver() -> tuple[str | None, str]:
    """(the NVIDIA driver's version, "") from NVML, or (None, why it is unknown)."""
    try:
        import pynvml  # nvidia-ml-py
    except ModuleNotFoundError:
        return None, "nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError as error:
        return None, f"NVML: {error}"
    return (version.decode() if isinstance(version, bytes) else version), ""


def hardware() -> dict[str, Any]:
    gpus: list[dict[str, Any]] = []
    info: dict[str, Any] = {
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "gpus": gpus,
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"name": props.name, "memory_bytes": props.total_memory})
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["driver"], driver_reason = nvidia_driver()
        if driver_reason:
            info["driver_reason"] = driver_reason
    return info


def network_interfaces() -> list[dict[str, Any]]:
    """The host's network interfaces that are up, loopback aside: name, link speed (Mb/s as
    the driver reports it; 0 where it does not) and MTU. Ethernet and InfiniBand (IPoIB)
    links both appear; the RDMA devices say which fabric RDMA can use."""
    return [{"name": name, "speed_mbps": stats.speed, "mtu": stats.mtu}
            for name, stats in sorted(psutil.net_if_stats().items())
            if stats.isup and name != "lo"]


def rdma_devices() -> list[str]:
    """The host's RDMA devices (InfiniBand or RoCE HCAs, which NCCL's IB transport uses), as
    the kernel lists them."""
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def gpu_topology() -> tuple[str | None, str]:
    """(``nvidia-smi topo -m``'s matrix: how each GPU reaches each other GPU and each NIC
    (NV# NVLink, PIX/PXB PCIe switches, PHB/NODE/SYS through the CPU), "") or (None, why not)."""
    if shutil.which("nvidia-smi") is None:
        return None, "nvidia-smi is not on PATH"
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"nvidia-smi topo -m: {error}"
    if out.returncode != 0:
        return None, f"nvidia-smi topo -m exited with status {out.returncode}: {out.stderr.strip()[-300:]}"
    return out.stdout.rstrip(), ""


def interconnect() -> dict[str, Any]:
    """What the ranks communicate over, so that runs on different fabrics can be told apart."""
    info: dict[str, Any] = {"network": network_interfaces(), "rdma_devices": rdma_devices()}
    if torch.cuda.is_available():
        info["gpu_topology"], reason = gpu_topology()
        if reason:
            info["gpu_topology_reason"] = reason
    return info


def collect(repo: Path) -> dict[str, Any]:
    status = _git(repo, "status", "--porcelain")
    return {
        "hardware": hardware(),
        "interconnect": interconnect(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in LIBRARIES},
        "git": {
            "commit": _git(repo, "rev-parse", "HEAD"),
            "dirty": bool(status) if status is not None else None,
        },
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
    }
