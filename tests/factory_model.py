"""A model of one's own for the factory tests (tests/test_model_sources.py): the contract of
README "Models", a module with repeated blocks and a function that makes its batches."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, CLASSES = 32, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            features = block(features)
        return F.cross_entropy(self.head(features), targets)


def classifier():
    def make_batch(generator: torch.Generator, batch_size: int) -> dict[str, torch.Tensor]:
        return {"features": torch.randn(batch_size, WIDTH, generator=generator),
                "targets": torch.randint(CLASSES, (batch_size,), generator=generator)}

    return Classifier(), make_batch


def not_a_pair():
    return nn.Linear(2, 2)
