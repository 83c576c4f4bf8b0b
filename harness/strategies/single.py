"""The one-process reference every other strategy is checked against."""

from __future__ import annotations

from torch import nn

from harness.config import CellSpec
from harness.distributed import DistEnv
from harness.features import optimizers
from harness.strategies.base import Capabilities, Prepared

CAPABILITIES = Capabilities(min_world_size=1, max_world_size=1, optimizers=frozenset(optimizers.NAMES))


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    model = model.to(env.device)
    return Prepared(model=model, optimizer=optimizers.make(model.parameters(), cell.strategy.optimizer, cell.lr))
