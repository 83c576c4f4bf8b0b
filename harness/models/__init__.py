"""Standard models built from configs with random init (no downloads), synthetic data, FLOPs."""

from .built import BuiltModel, analytic_n_params, build, flops_per_sample
from .presets import PRESETS, get_preset
from .spec import ModelSpec

__all__ = ["PRESETS", "BuiltModel", "ModelSpec", "analytic_n_params", "build", "flops_per_sample",
           "get_preset"]
