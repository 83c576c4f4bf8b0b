"""The one-process reference every other strategy is checked against."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.features import optimizers
from harness.strategies.base import Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from torch import nn

    from harness.config import CellSpec
    from harness.distributed import DistEnv


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    model = model.to(env.device)
    return Prepared(model=model, optimizer=optimizers.make(model.parameters(), cell.strategy.optimizer, cell.lr))


STRATEGIES = (
    Strategy(
        name="single",
        summary="the single-process reference run",
        engine="torch",
        families=("reference",),
        capabilities=Capabilities(min_world_size=1, max_world_size=1, optimizers=frozenset(optimizers.NAMES)),
        engine_model=EngineModel(),
        prepare=prepare,
    ),
)
