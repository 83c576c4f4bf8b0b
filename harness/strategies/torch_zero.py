"""ZeRO-1 the PyTorch way: ZeroRedundancyOptimizer shards AdamW's state over the ranks,
DDP still all-reduces full gradients, and each rank broadcasts its updated shard."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from harness.features import optimizers
from harness.strategies import ddp
from harness.strategies.base import AUTOCAST_BLOCK_OPTIONS, Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from harness.config import CellSpec
    from harness.distributed import DistEnv


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    ddp_model = ddp.wrap(model, cell, env)
    optimizer_class, kwargs = optimizers.optimizer_class_and_kwargs(cell.strategy.optimizer, cell.lr)
    optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=optimizer_class, **kwargs)
    return Prepared(model=ddp_model, optimizer=optimizer, no_sync=ddp_model.no_sync,
                    all_reduces_kept_buffers=ddp.all_reduces_buckets(cell),
                    engine_report=lambda: ddp.engine_report(ddp_model))


STRATEGIES = (
    Strategy(
        name="zero1",
        summary="ZeRO-1 the PyTorch way: ZeroRedundancyOptimizer shards the optimizer state over DDP",
        engine="torch",
        families=("ddp",),
        zero_idea="zero1",
        capabilities=Capabilities(optimizers=frozenset(optimizers.NAMES), overlap_options=ddp.BUCKET_OPTIONS,
                                  block_options=AUTOCAST_BLOCK_OPTIONS),
        engine_model=EngineModel(sharded=frozenset({"optimizer"}), optimizer_partition="largest_first",
                                 grad_buffer="ddp_bucket", comm="all_reduce"),
        prepare=prepare,
    ),
)
