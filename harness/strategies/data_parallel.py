"""torch.nn.DataParallel: one process drives every visible GPU. Each forward replicates the
module onto every GPU, scatters the batch, runs the replicas in threads and gathers the
outputs on GPU 0, where backward sums the replicas' gradients into the one module's (Li et
al. 2020, the DDP paper, §2 on why DDP replaced it: the GIL and the replication every
iteration). The course's DataParallel-against-DDP comparison (B13): the same cell beside DDP
over as many GPUs, a process per GPU.

A DataParallel cell is one process taking the whole global batch, as the reference does:
world size 1, its micro-batch the reference's, and it is gated against the reference. Its
peak memory is GPU 0's, which holds the module, the gradients, the optimizer state and the
gathered outputs (DataParallel's known imbalance). The loss of each replica is averaged over
them (the batch is split evenly, so that is the whole batch's mean). Its copies between GPUs
(the parameters broadcast to every replica each forward, the gradients summed onto GPU 0)
are CUDA copies, not collectives of a process group: the comm counter does not see them and
the analytic model lists none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from harness.features import optimizers
from harness.strategies.base import Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from harness.config import CellSpec
    from harness.distributed import DistEnv

ON_CPU = ("DataParallel replicates the module over the visible GPUs; with none, torch runs the bare module"
          " (no device_ids), which would measure the single-process reference under another name")


class MeanLossDataParallel(nn.DataParallel):  # type: ignore[type-arg]  # its module type is any
    """DataParallel whose gathered per-replica losses (one per GPU) become their mean."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        out = super().forward(*inputs, **kwargs)
        loss = getattr(out, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.dim() == 1:
            out.loss = loss.mean()
        return out


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    wrapped = MeanLossDataParallel(model.to(env.device))  # every visible GPU, outputs on GPU 0
    return Prepared(model=wrapped, optimizer=optimizers.make(wrapped.parameters(), cell.strategy.optimizer, cell.lr),
                    engine_report=lambda: {"name": "torch_data_parallel", "device_ids": list(wrapped.device_ids)})


def unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    if device_type != "cuda":
        return ON_CPU
    visible = torch.cuda.device_count()
    if visible < 2:
        return f"DataParallel needs two or more visible GPUs to split the batch over; this host has {visible}"
    if cell.micro_batch % visible:
        return f"micro_batch={cell.micro_batch} does not split evenly over the {visible} visible GPUs"
    return None


STRATEGIES = (
    Strategy(
        name="dataparallel",
        summary="torch.nn.DataParallel: one process, the module replicated over every visible GPU each step",
        engine="torch",
        capabilities=Capabilities(min_world_size=1, max_world_size=1, optimizers=frozenset(optimizers.NAMES)),
        unsupported_reason=unsupported_reason,
        engine_model=EngineModel(),
        prepare=prepare,
    ),
)
