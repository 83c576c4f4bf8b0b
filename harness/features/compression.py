"""Gradient compression as DDP communication hooks.

fp16 / bf16 halve the all-reduce bytes; PowerSGD sends rank-r factors P (m×r) and Q (n×r)
instead of an m×n gradient. On gloo, PowerSGD is only reliable with a single gradient bucket
(several buckets abort intermittently with "op.preamble.length <= op.nbytes"), so on gloo the
DDP strategy sizes its bucket to the whole model when this hook is on. NCCL keeps DDP's
buckets, and with them the overlap of communication with backward.
"""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from harness.config import POWERSGD_START_ITER


def needs_single_bucket(compression: str, backend: str) -> bool:
    return compression == "powersgd" and backend == "gloo"


def register(ddp_model: DistributedDataParallel, compression: str, powersgd_rank: int) -> None:
    if compression == "none":
        return
    if compression == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif compression == "bf16":
        ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=POWERSGD_START_ITER,
            random_seed=0,
        )
        ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(f"compression={compression!r}: choose none, fp16, bf16 or powersgd")
