"""The environment recorded with every run: hardware, library versions, git state, and the
variables that change how collectives and the allocator behave."""

from __future__ import annotations

import importlib.metadata
import os
import platform
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


def collect(repo: Path) -> dict[str, Any]:
    status = _git(repo, "status", "--porcelain")
    return {
        "hardware": hardware(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in LIBRARIES},
        "git": {
            "commit": _git(repo, "rev-parse", "HEAD"),
            "dirty": bool(status) if status is not None else None,
        },
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
    }
