"""Peak dense FLOP/s of known devices, for MFU. Datasheet numbers (formulas.md, "FLOPs and
MFU"); an unknown device gets no MFU at all, never a guessed peak.

Keyed by the exact name torch.cuda.get_device_name() reports, because variants sharing a
family name differ a lot (H100 SXM 989 TFLOP/s bf16, H100 PCIe 756).
"""

from __future__ import annotations

# device name -> {precision: dense peak FLOP/s}
PEAK_DENSE_FLOPS = {
    "NVIDIA A100-SXM4-40GB": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "NVIDIA A100-SXM4-80GB": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "NVIDIA H100 80GB HBM3": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "NVIDIA H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
}


def peak_flops(device_name: str | None, precision: str) -> float | None:
    return PEAK_DENSE_FLOPS.get(device_name or "", {}).get(precision)
