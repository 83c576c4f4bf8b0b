"""ViT (Dosovitskiy et al. 2021) image classification through ViTForImageClassification."""

from __future__ import annotations

import torch
from torch import nn
from transformers import ViTConfig, ViTForImageClassification

from .common import ParamCount, hf_attention, hf_loss, linear
from .spec import VIT_CHANNELS, ModelSpec

loss = hf_loss


def build_module(spec: ModelSpec, attention: str = "sdpa") -> nn.Module:
    # attn_implementation and num_labels go through the config's **kwargs, which its dataclass
    # signature does not declare.
    config = ViTConfig(  # type: ignore[call-arg]
        hidden_size=spec.hidden, num_hidden_layers=spec.n_layers, num_attention_heads=spec.required("n_heads"),
        intermediate_size=spec.ffn, image_size=spec.required("image_size"), patch_size=spec.required("patch_size"),
        num_channels=VIT_CHANNELS, num_labels=spec.required("num_classes"),
        # Set up front: HF would otherwise infer it on the first forward by mutating the config.
        problem_type="single_label_classification",
        # Dropout draws from each rank's RNG, which would break equality with the 1-process run.
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation=hf_attention(attention),
    )
    return ViTForImageClassification(config)


def make_batch(spec: ModelSpec, generator: torch.Generator, batch_size: int) -> dict[str, torch.Tensor]:
    image_size = spec.required("image_size")
    shape = (batch_size, VIT_CHANNELS, image_size, image_size)
    return {
        "pixel_values": torch.randn(shape, generator=generator, dtype=torch.float32),
        "labels": torch.randint(spec.required("num_classes"), (batch_size,), generator=generator),
    }


def count_params(spec: ModelSpec) -> ParamCount:
    h, f, p = spec.hidden, spec.ffn, spec.required("patch_size")
    block = 2 * h + 4 * linear(h, h) + 2 * h + linear(h, f) + linear(f, h)
    # Class token and position table are looked up, not multiplied; the patch conv is a matmul.
    embedding = h + spec.tokens_per_sample * h
    patch_conv = linear(VIT_CHANNELS * p * p, h)
    head = 2 * h + linear(h, spec.required("num_classes"))  # final LayerNorm, classifier
    return ParamCount(embedding + patch_conv + spec.n_layers * block + head, embedding)
