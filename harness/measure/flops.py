"""Peak dense FLOP/s of known devices, for MFU. Datasheet numbers (formulas.md, "FLOPs and
MFU"); an unknown device gets no MFU at all, never a guessed peak."""

from __future__ import annotations

# (substring of torch.cuda.get_device_name(), precision) -> dense peak FLOP/s per device.
PEAK_DENSE_FLOPS = {
    ("A100", "bf16"): 312e12,
    ("A100", "fp16"): 312e12,
    ("A100", "fp32"): 19.5e12,
    ("H100", "bf16"): 989e12,
    ("H100", "fp16"): 989e12,
    ("H100", "fp32"): 67e12,
    ("H200", "bf16"): 989e12,
    ("H200", "fp16"): 989e12,
    ("H200", "fp32"): 67e12,
}


def peak_flops(device_name: str | None, precision: str) -> float | None:
    if not device_name:
        return None
    for (key, prec), peak in PEAK_DENSE_FLOPS.items():
        if key in device_name and prec == precision:
            return peak
    return None
