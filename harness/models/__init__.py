"""Standard models built from configs with random init (no downloads), synthetic data, FLOPs."""

from .built import BuiltModel, ParamLayout, analytic_n_params, build, flops_per_sample, param_layout
from .presets import PRESETS, get_preset
from .spec import ModelSpec

__all__ = ["PRESETS", "BuiltModel", "ModelSpec", "ParamLayout", "analytic_n_params", "build",
           "flops_per_sample", "get_preset", "param_layout"]
