"""Peak dense FLOP/s and memory bandwidth of known devices, for MFU and for pricing steps on a
GPU no run has measured. Datasheet numbers (formulas.md, "FLOPs and
MFU"; NVIDIA's A100 / H100 / H200 datasheets, dense, i.e. without 2:4 sparsity); an unknown
device gets no MFU at all, never a guessed peak.

Keyed by the exact name torch.cuda.get_device_name() reports, because variants sharing a
family name differ a lot (H100 SXM 989 TFLOP/s bf16, H100 PCIe 756). "NVIDIA H200" is the
SXM part (the NVL part reports "NVIDIA H200 NVL" and is not listed).

fp32 has two peaks: plain fp32 on the CUDA cores, and TF32 on the tensor cores, which
fp32 matmuls use when ``torch.get_float32_matmul_precision()`` is "high" or "medium" (the
worker records it per rank). ``compute_precision`` picks the one that applies.
"""

from __future__ import annotations

_A100 = {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
_H100_SXM = {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}
_H100_PCIE = {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}

# device name -> {precision: dense peak FLOP/s}
PEAK_DENSE_FLOPS = {
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": _H100_PCIE,
    "NVIDIA H200": _H100_SXM,  # same compute as H100 SXM; more and faster memory
}


def compute_precision(precision: str, float32_matmul_precision: str | None) -> str:
    """The peak's key for a cell's ``precision``: "tf32" for fp32 with TF32 matmuls on."""
    if precision == "fp32" and float32_matmul_precision in ("high", "medium"):
        return "tf32"
    return precision


# device name -> memory bandwidth, B/s (the same datasheets: HBM2e for A100 80GB, HBM3 for
# H100 SXM, HBM3e for H200), what the optimizer step's and other memory-bound traffic is priced at
PEAK_MEMORY_BYTES_PER_S = {
    "NVIDIA A100-SXM4-40GB": 1.555e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA A100-PCIE-40GB": 1.555e12,
    "NVIDIA A100 80GB PCIe": 1.935e12,
    "NVIDIA H100 80GB HBM3": 3.35e12,
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA H200": 4.8e12,
}


def peak_flops(device_name: str | None, precision: str) -> float | None:
    return PEAK_DENSE_FLOPS.get(device_name or "", {}).get(precision)


def known_device(name: str) -> str:
    """The listed device ``name`` stands for: the one listed name holding each of its words
    (case aside, "-" and spaces alike: "h200", "A100-SXM4-80GB", "a100 80gb pcie");
    ValueError, naming the choices, where none or several do ("A100 80GB": SXM or PCIe)."""
    wanted = _words(name)
    if not wanted:
        raise ValueError("an empty GPU name")
    matches = [known for known in PEAK_DENSE_FLOPS if wanted <= _words(known)]
    exact = [known for known in matches if _words(known) == wanted]
    if len(exact) == 1 or len(matches) == 1:
        return (exact or matches)[0]
    what = "several GPUs" if matches else "no GPU whose peaks are known"
    raise ValueError(f"{name!r} names {what}: choose one of {'; '.join(matches or PEAK_DENSE_FLOPS)}")


def _words(name: str) -> set[str]:
    return set(name.lower().replace("-", " ").split())


def no_peak_warning(device_type: str, device_name: str | None) -> str | None:
    """The run's one line on a device without a known peak (no MFU for any cell), or None."""
    if device_name in PEAK_DENSE_FLOPS:
        return None
    what = device_name or f"this {device_type} device"
    return (f"shardbench: warning: no peak FLOP/s known for {what} (harness/measure/flops.py):"
            " no cell of this run gets an MFU")
