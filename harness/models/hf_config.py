"""Family hf_config: a model from a transformers config.json, built with random weights by
the Auto class of its task (harness.models.sources resolved the config; nothing is downloaded)."""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMaskedLM,
    PretrainedConfig,
)

from . import bert
from .common import ParamCount, causal_lm_batch, counted_on_meta, hf_attention, hf_loss
from .spec import ModelSpec, TransformersConfig

_AUTO_CLASSES = {"causal_lm": AutoModelForCausalLM, "masked_lm": AutoModelForMaskedLM,
                 "image_classification": AutoModelForImageClassification}
loss = hf_loss


def transformers_config(hf: TransformersConfig, attention: str | None = None) -> PretrainedConfig:
    config = dict(hf.config)
    model_type = config.pop("model_type")
    if attention is not None:
        config["attn_implementation"] = hf_attention(attention)
    return AutoConfig.for_model(model_type, **config)


@functools.cache
def resolved(hf: TransformersConfig) -> PretrainedConfig:
    """The config as transformers resolves it, its class's defaults filled in, for the
    predictors to read (not to change: it is shared)."""
    return transformers_config(hf)


def rotary_fraction(hf: TransformersConfig) -> float:
    """The share of each head's width its rotary embedding turns (transformers' resolved
    ``partial_rotary_factor``: 0.5 for GLM-4.5, 0.25 for StableLM; 1 where every channel turns)."""
    rope = getattr(resolved(hf), "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor", 1.0))


def build_module(spec: ModelSpec, attention: str | None = None) -> nn.Module:
    """The model with random weights; ``attention`` None: SDPA where its class has it, else
    eager (the meta-device builds that count parameters and read the layout)."""
    hf = _hf(spec)
    attention = attention or ("sdpa" if hf.sdpa else "eager")
    # An attention-free model (Mamba, RWKV) takes no attention implementation.
    config = transformers_config(hf, attention if spec.has_attention else None)
    module: nn.Module = _AUTO_CLASSES[hf.task].from_config(config)
    return module


def make_batch(spec: ModelSpec, generator: torch.Generator, batch_size: int) -> dict[str, torch.Tensor]:
    task = _hf(spec).task
    if task == "causal_lm":
        return causal_lm_batch(spec, generator, batch_size)
    if task == "masked_lm":
        return bert.make_batch(spec, generator, batch_size)  # the same count of masked tokens per sample
    channels = int(_hf(spec).config.get("num_channels", 3))
    image_size = spec.required("image_size")
    return {
        "pixel_values": torch.randn((batch_size, channels, image_size, image_size), generator=generator),
        "labels": torch.randint(spec.required("num_classes"), (batch_size,), generator=generator),
    }


def count_params(spec: ModelSpec) -> ParamCount:
    """Counted on a build on the meta device (no memory): the lookup tables are the model's
    nn.Embedding weights, a LM head tied to one of them is credited with its matmul."""
    return counted_on_meta(build_module, spec)


def _hf(spec: ModelSpec) -> TransformersConfig:
    if spec.hf is None:
        raise ValueError(f"model {spec.name}: family hf_config without a config")
    return spec.hf
