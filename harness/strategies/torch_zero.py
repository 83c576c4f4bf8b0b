"""ZeRO-1 the PyTorch way: ZeroRedundancyOptimizer shards AdamW's state over the ranks,
DDP still all-reduces full gradients, and each rank broadcasts its updated shard."""

from __future__ import annotations

from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from harness.config import CellSpec
from harness.distributed import DistEnv
from harness.features import optimizers
from harness.strategies import ddp
from harness.strategies.base import Capabilities, Prepared

CAPABILITIES = Capabilities(optimizers=frozenset(optimizers.NAMES))


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    ddp_model = ddp.wrap(model, cell, env)
    optimizer_class, kwargs = optimizers.optimizer_class_and_kwargs(cell.strategy.optimizer, cell.lr)
    optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=optimizer_class, **kwargs)
    return Prepared(model=ddp_model, optimizer=optimizer, no_sync=ddp_model.no_sync)
