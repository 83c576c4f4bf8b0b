"""A residual MLP in plain torch: the fastest model, for tests of the harness itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import ParamCount, linear
from .spec import ModelSpec


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block: the unit for activation checkpointing and FSDP sharding."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))




class MLPModel(nn.Module):
    """The blocks, a final norm and a classifier head."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(spec.hidden, spec.ffn) for _ in range(spec.n_layers))
        self.norm = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.required("num_classes"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def build_module(spec: ModelSpec, attention: str = "sdpa") -> nn.Module:
    # No attention to implement: CellSpec refuses anything but the default for mlp.
    return MLPModel(spec)


def make_batch(spec: ModelSpec, generator: torch.Generator, batch_size: int) -> dict[str, torch.Tensor]:
    """Random inputs with random class targets: a classification task to fit."""
    return {
        "inputs": torch.randn(batch_size, spec.hidden, generator=generator),
        "targets": torch.randint(spec.required("num_classes"), (batch_size,), generator=generator),
    }


def loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(module(batch["inputs"]), batch["targets"])


def count_params(spec: ModelSpec) -> ParamCount:
    h, f = spec.hidden, spec.ffn
    block = 2 * h + linear(h, f) + linear(f, h)
    return ParamCount(spec.n_layers * block + 2 * h + linear(h, spec.required("num_classes")), 0)
