"""The pytest markers of a cell, and the catalogue pytest registers (--strict-markers).

One marker per axis value (``fsdp_full``, ``bf16``, ``ckpt_selective``, ``accum4`` …) plus
family markers (``fsdp``, ``fsdp1``), so ``-m "fsdp and bf16"`` selects what a user expects.
"""

from __future__ import annotations

import re
from typing import get_args

from harness.config import STRATEGY_NAMES, CellSpec, Checkpointing, Compression, Offload, Precision

MODEL_FAMILIES = ("gpt2", "llama", "bert", "vit", "mlp")
ACCUMULATION_MARKERS = (1, 2, 4, 8)
WORLD_SIZE_MARKERS = (1, 2, 4, 8, 16)

# Strategy -> the family markers it also carries.
STRATEGY_FAMILIES = {
    "single": ("reference",),
    "ddp": ("ddp",),
    "zero1": ("zero1", "ddp"),
    "fsdp_full": ("fsdp",),
    "fsdp_grad_op": ("fsdp",),
    "fsdp_hybrid": ("fsdp",),
    "fsdp1_full": ("fsdp1",),
    "fsdp1_grad_op": ("fsdp1",),
    "fsdp1_no_shard": ("fsdp1",),
    "fsdp1_hybrid": ("fsdp1",),
}

CATALOGUE: dict[str, str] = {
    **{name: f"strategy {name}" for name in STRATEGY_NAMES},
    "reference": "the single-process reference run",
    "fsdp": "any FSDP2 (fully_shard) strategy",
    "fsdp1": "any FSDP1 (FullyShardedDataParallel) strategy",
    **{p: f"precision {p}" for p in get_args(Precision)},
    **{f"ckpt_{c}": f"activation checkpointing: {c}" for c in get_args(Checkpointing)},
    **{f"offload_{o}": f"offload: {o}" for o in get_args(Offload)},
    **{f"accum{n}": f"gradient accumulation over {n} micro-steps" for n in ACCUMULATION_MARKERS},
    **{f"compress_{c}": f"gradient compression: {c}" for c in get_args(Compression)},
    **{f"ws{n}": f"world size {n}" for n in WORLD_SIZE_MARKERS},
    **{family: f"model family {family}" for family in MODEL_FAMILIES},
}


def markers_of(cell: CellSpec) -> list[str]:
    from harness.models import get_preset  # models pull in transformers: import on use

    s = cell.strategy
    family = get_preset(cell.model).family
    marks = [
        s.name,
        *STRATEGY_FAMILIES[s.name],
        s.precision,
        f"ckpt_{s.checkpointing}",
        f"offload_{s.offload}",
        f"accum{s.accumulation}",
        f"compress_{s.compression}",
        f"ws{cell.world_size}",
        family,
    ]
    unknown = [m for m in marks if m not in CATALOGUE]
    if unknown:
        raise ValueError(f"cell {cell.cell_id} has unregistered markers {unknown}")
    return list(dict.fromkeys(marks))  # de-duplicated, order kept (zero1 lists itself twice)


_KEYWORDS = {"and", "or", "not"}


def check_marker_expression(expr: str) -> None:
    """Refuse a ``-m`` expression naming a marker that does not exist.

    pytest would silently select nothing for ``-m zero4``; a benchmark run that measures
    nothing because of a typo wastes a cluster allocation.
    """
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr)) - _KEYWORDS
    unknown = sorted(names - CATALOGUE.keys())
    if unknown:
        raise ValueError(
            f"unknown marker(s) {', '.join(unknown)} in -m {expr!r}: "
            f"choose from {', '.join(sorted(CATALOGUE))}"
        )
