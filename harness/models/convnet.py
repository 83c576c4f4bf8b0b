"""A small convolutional network with BatchNorm in plain torch, for images such as
scikit-learn's 8×8 digits (data="digits", harness/data.py): what BatchNorm's statistics under
data parallelism and gradient accumulation are measured on (the convergence suite).

Each block is a 3×3 convolution (no bias: BatchNorm's shift replaces it), BatchNorm and ReLU,
at the image's full resolution; the first takes the grayscale image to ``hidden`` channels,
the rest keep ``hidden``. Global average pooling and a linear classifier follow.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from .common import ParamCount, linear
from .spec import CONVNET_CHANNELS, ModelSpec

KERNEL = 3


class ConvBlock(nn.Module):
    """Convolution, BatchNorm, ReLU: the unit for activation checkpointing and FSDP sharding."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, KERNEL, padding=KERNEL // 2, bias=False)
        self.norm = nn.BatchNorm2d(channels_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class ConvNet(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        widths = [CONVNET_CHANNELS] + [spec.hidden] * spec.n_layers
        self.blocks = nn.ModuleList(ConvBlock(a, b) for a, b in itertools.pairwise(widths))
        self.head = nn.Linear(spec.hidden, spec.required("num_classes"))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(x.mean(dim=(2, 3)))
        return logits


def build_module(spec: ModelSpec, attention: str = "sdpa") -> nn.Module:
    # No attention to implement: CellSpec refuses anything but the default for convnet.
    return ConvNet(spec)


def make_batch(spec: ModelSpec, generator: torch.Generator, batch_size: int) -> dict[str, torch.Tensor]:
    size = spec.required("image_size")
    return {
        "pixel_values": torch.randn(batch_size, CONVNET_CHANNELS, size, size, generator=generator),
        "labels": torch.randint(spec.required("num_classes"), (batch_size,), generator=generator),
    }


def loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(module(batch["pixel_values"]), batch["labels"])


def loss_and_correct(module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean loss and how many samples the model classifies right (one forward)."""
    logits = module(batch["pixel_values"])
    return F.cross_entropy(logits, batch["labels"]), (logits.argmax(dim=-1) == batch["labels"]).sum()


def _conv_weights(spec: ModelSpec) -> int:
    h = spec.hidden
    return KERNEL * KERNEL * (CONVNET_CHANNELS * h + (spec.n_layers - 1) * h * h)


def count_params(spec: ModelSpec) -> ParamCount:
    batch_norm = 2 * spec.hidden * spec.n_layers  # each channel's scale and shift
    return ParamCount(_conv_weights(spec) + batch_norm + linear(spec.hidden, spec.required("num_classes")), 0)


def flops_per_sample(spec: ModelSpec) -> float:
    """Training FLOPs per image: 6 per weight and use (forward 2, backward 4, as in the PaLM
    formula), a convolution's weights being used once per output position (image_size², the
    padding keeps the resolution), the classifier's once. Normalisation, ReLU and pooling are
    no matmuls and are left out."""
    positions = spec.required("image_size") ** 2
    return 6.0 * (_conv_weights(spec) * positions + spec.hidden * spec.required("num_classes"))
