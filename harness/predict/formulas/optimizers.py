"""Optimizer state per parameter tensor: Adam(W), block-wise 8-bit Adam, LAMB, Adafactor, SGD
with momentum."""

from __future__ import annotations

import math
from collections.abc import Sequence

_BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps 32-bit state for smaller tensors
_BNB_BLOCK = 256  # one fp32 absmax per 256 values, per state
_BNB_QMAP_BYTES = 2 * 256 * 4  # the two 256-entry fp32 quantisation maps, shared by all tensors

Shapes = Sequence[tuple[int, ...]]


def adamw_state_bytes(shapes: Shapes) -> float:
    """AdamW's state for fp32 parameters of these shapes: Adam's two fp32 moments (Kingma &
    Ba 2015, Algorithm 1; decoupled weight decay adds none, Loshchilov & Hutter 2019), 8 B per
    parameter, plus torch's fp32 step counter per tensor."""
    return sum((8 * math.prod(shape) + 4 for shape in shapes), 0.0)


def blockwise_8bit_state_bytes(shapes: Shapes) -> float:
    """Block-wise 8-bit Adam's state (Dettmers et al. 2022, block-wise quantization, as
    bitsandbytes implements it): two uint8 states (2 B per parameter) and one fp32 absmax per
    256-value block per state; tensors under 4096 values keep two fp32 states (bitsandbytes'
    min_8bit_size); plus the two shared quantisation maps once any tensor is quantised."""
    total = 0.0
    any_8bit = False
    for shape in shapes:
        n = math.prod(shape)
        if n < _BNB_MIN_8BIT_SIZE:
            total += 8 * n
        else:
            any_8bit = True
            total += 2 * n + 2 * 4 * math.ceil(n / _BNB_BLOCK)
    return total + (_BNB_QMAP_BYTES if any_8bit else 0)


def lamb_state_bytes(shapes: Shapes, eight_bit: bool, update_norms: bool = True) -> float:
    """LAMB's state (You et al. 2020, Algorithm 2: Adam's two moments, and a per-tensor trust
    ratio computed each step): the two moments in fp32 (8 B per parameter) or block-wise 8-bit
    (``blockwise_8bit_state_bytes``), and, as bitsandbytes keeps it, one fp32 update norm per
    tensor (``unorm_vec``; DeepSpeed's FusedLamb keeps none: ``update_norms``)."""
    moments = blockwise_8bit_state_bytes(shapes) if eight_bit else sum((8 * math.prod(s) for s in shapes), 0.0)
    return moments + (4 * len(shapes) if update_norms else 0)


def adafactor_state_bytes(shapes: Shapes) -> float:
    """Adafactor's state (Shazeer & Stern 2018, §3, factored second-moment estimation): a row
    and a column statistic (n + m values) for an n×m matrix, the full variance for vectors, no
    first moment (torch.optim.Adafactor's default), fp32, plus a step counter per tensor."""
    total = 0.0
    for shape in shapes:
        factored = len(shape) >= 2
        total += 4 * ((math.prod(shape[:-1]) + shape[-1]) if factored else math.prod(shape)) + 4
    return total


def sgd_momentum_state_bytes(shapes: Shapes) -> float:
    """SGD with momentum's state for fp32 parameters (Polyak's heavy ball, as torch.optim.SGD
    keeps it): one fp32 momentum buffer per parameter, 4 B per parameter, and no step counter."""
    return sum((4 * math.prod(shape) for shape in shapes), 0.0)
