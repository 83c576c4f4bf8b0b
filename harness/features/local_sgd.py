"""Local SGD: each rank steps on its own gradients and the ranks average their parameters
every ``period`` steps (Stich 2019, "Local SGD Converges Fast and Communicates Little";
Lin et al. 2020, "Don't Use Large Mini-Batches, Use Local SGD", whose post-local SGD starts
it after a phase of ordinary data parallelism), with torch's own parts: DDP's
``post_localSGD_hook`` (the gradients all-reduced over every rank until ``start``, then not at
all: ``post_local_gradient_allreduce=False``) and ``PostLocalSGDOptimizer`` with a
``PeriodicModelAverager`` (one all-reduce of the flattened parameters every ``period``-th step
from ``start``).

``start`` is the harness's comm-counted step (after the warm-up and the memory step, which
are DDP's): the counted step is the first averaging, so the record's communication is an
averaging step's, the bytes sent every ``period``-th step; the steps between send nothing.
Between averagings the ranks hold different parameters: the loss a step records is the mean
of the ranks' own models' losses, and so is a held-out loss taken then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from harness.config import CellSpec


def start_step(cell: CellSpec) -> int:
    """The first step the ranks train apart, and the first averaging (module docstring)."""
    return cell.warmup_steps + 1


def register_hook(ddp_model: DistributedDataParallel, cell: CellSpec) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook

    state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=None,
                                                 start_localSGD_iter=start_step(cell),
                                                 post_local_gradient_allreduce=False)
    ddp_model.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)


def averaging_optimizer(optimizer: torch.optim.Optimizer, cell: CellSpec) -> torch.optim.Optimizer:
    """``optimizer`` followed, every ``local_sgd_period`` steps from ``start_step``, by the
    ranks' parameter average."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    period = cell.strategy.local_sgd_period
    if period is None:
        raise ValueError(f"{cell.cell_id}: no local_sgd_period")
    return PostLocalSGDOptimizer(optim=optimizer,
                                 averager=PeriodicModelAverager(period=period, warmup_steps=start_step(cell)))
