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

CAPABILITIES = Capabilities()


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    ddp_model = ddp.wrap(model, cell, env)
    optimizer = ZeroRedundancyOptimizer(
        ddp_model.parameters(),
        optimizer_class=optimizers.OPTIMIZER_CLASS,
        **optimizers.optimizer_kwargs(cell.lr),
    )
    return Prepared(model=ddp_model, optimizer=optimizer, no_sync=ddp_model.no_sync)
