"""Gradient compression: what PowerSGD all-reduces (Vogels et al. 2019), what torch's int8
quantization hooks and top-k / random-k sparsification send per gradient bucket."""

from __future__ import annotations

import math

POWERSGD_MIN_COMPRESSION_RATE = 2  # torch PowerSGDState's default


def powersgd_elements(shape: tuple[int, ...], rank: int) -> int:
    """Elements all-reduced for one gradient under PowerSGD (Vogels et al. 2019, Algorithm 1;
    torch's powerSGD_hook): a tensor viewed as m×n (first dimension × the rest) is sent as
    rank-r factors P (m×r) and Q (n×r) when (m + n)·r·min_compression_rate < m·n; otherwise
    (and for vectors) as is."""
    n_total = math.prod(shape)
    if len(shape) < 2:
        return n_total
    m, n = shape[0], n_total // shape[0]
    r = min(rank, m, n)
    compressed = (m + n) * r
    return compressed if compressed * POWERSGD_MIN_COMPRESSION_RATE < m * n else n_total


def int8_allgather_bytes(numel: int, world_size: int, channel: int | None = None) -> int:
    """Bytes all-gathered for one bucket of ``numel`` gradients by torch's quantization hooks,
    counted as gathered (every rank's part): each rank's scale and zero point (2 fp32), then
    its uint8 bucket. Per channel (``channel`` elements each) the bucket is padded to whole
    channels, and the hook pads by a whole channel when ``numel`` divides evenly, so there
    are numel // channel + 1 channels, each with its own scale and zero point."""
    if channel is None:
        return world_size * (8 + numel)
    channels = numel // channel + 1
    return world_size * channels * (8 + channel)


def sparsified_bytes(numel: int, world_size: int, density: float, selection: str) -> int:
    """Bytes one bucket of ``numel`` gradients sends under k-sparsification, k =
    ceil(density · numel): top-k (Aji & Heafield 2017; Lin et al. 2018) all-gathers every
    rank's k fp32 values and k int32 indices, 8·n·k as gathered; random-k (Stich et al.
    2018), whose indices every rank draws alike, all-reduces the k values, 4·k."""
    k = max(1, math.ceil(density * numel))
    return 8 * world_size * k if selection == "topk" else 4 * k
