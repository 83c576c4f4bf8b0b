"""The one-process reference every other strategy is checked against."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.features import optimizer_in_backward, optimizers
from harness.strategies.base import AUTOCAST_BLOCK_OPTIONS, Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from torch import nn

    from harness.config import CellSpec
    from harness.distributed import DistEnv


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    model = model.to(env.device)
    if cell.strategy.optimizer_in_backward:
        loop, real = optimizer_in_backward.in_backward(
            model.parameters(), lambda params: optimizers.make(params, cell.strategy.optimizer, cell.lr))
        return Prepared(model=model, optimizer=loop, memory_optimizer=real)
    return Prepared(model=model, optimizer=optimizers.make(model.parameters(), cell.strategy.optimizer, cell.lr))


STRATEGIES = (
    Strategy(
        name="single",
        summary="the single-process reference run",
        engine="torch",
        families=("reference",),
        capabilities=Capabilities(min_world_size=1, max_world_size=1, optimizers=frozenset(optimizers.NAMES),
                                  overlap_options=frozenset({"optimizer_in_backward"}),
                                  block_options=AUTOCAST_BLOCK_OPTIONS),
        engine_model=EngineModel(),
        prepare=prepare,
    ),
)
