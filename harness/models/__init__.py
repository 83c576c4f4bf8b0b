"""Models built with random init (no downloads): presets, transformers config.json files and
factories of one's own (sources.py); synthetic data, FLOPs.

The specs and presets are plain data, read by harness.config without torch; the built
models (``build`` and what goes with it) load torch and transformers on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .presets import PRESETS, REAL_SIZE_PRESETS, get_preset
from .spec import ModelSpec

if TYPE_CHECKING:
    from .built import (
        LAYERNORM_KEEPS,
        BuiltModel,
        NormKeeps,
        ParamLayout,
        analytic_n_params,
        build,
        flops_per_sample,
        param_layout,
    )

_BUILT = frozenset({"LAYERNORM_KEEPS", "BuiltModel", "NormKeeps", "ParamLayout", "analytic_n_params", "build",
                    "flops_per_sample", "param_layout"})

__all__ = ["LAYERNORM_KEEPS", "PRESETS", "REAL_SIZE_PRESETS", "BuiltModel", "ModelSpec", "NormKeeps", "ParamLayout",
           "analytic_n_params", "build", "flops_per_sample", "get_preset", "param_layout"]


def __getattr__(name: str) -> object:
    if name in _BUILT:
        return getattr(importlib.import_module(".built", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
