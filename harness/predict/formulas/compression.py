"""Gradient compression: what PowerSGD all-reduces (Vogels et al. 2019)."""

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
