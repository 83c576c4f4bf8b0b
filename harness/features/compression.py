"""Gradient compression as DDP communication hooks.

fp16 / bf16 halve the all-reduce bytes; PowerSGD sends rank-r factors P (m×r) and Q (n×r)
instead of an m×n gradient; int8_tensor and int8_channel are torch's quantization hooks
(``quantization_pertensor_hook``, ``quantization_perchannel_hook``: each rank quantizes its
bucket to uint8 with its own scale and zero point, per bucket or per 512-element channel,
and all-gathers them; every rank dequantizes and averages); topk and randomk keep 1 % of the
entries with error feedback (features/sparsification.py, the project's own hook).

Every hook but fp16 and bf16 changes the update by design: such cells are not held to the
same-loss gate but judged by the convergence suite's final held-out loss (UNGATED,
harness/equivalence.py). On gloo, PowerSGD is only reliable with a single gradient bucket
(several buckets abort intermittently with "op.preamble.length <= op.nbytes"), so on gloo the
DDP strategy sizes its bucket to the whole model when this hook is on. NCCL keeps DDP's
buckets, and with them the overlap of communication with backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

NAMES = ("none", "fp16", "bf16", "powersgd", "int8_tensor", "int8_channel", "topk", "randomk")
# Compressions that change what is applied rather than how it travels.
UNGATED = frozenset({"powersgd", "int8_tensor", "int8_channel", "topk", "randomk"})
# quantization_perchannel_hook's channel: its default bucket_size.
INT8_CHANNEL = 512
# Measured with torch 2.13 on 2 gloo ranks (tests/test_measure_comm.py checks it still holds).
INT8_ON_GLOO = ("torch's quantization hooks read the all-gather future's value as NCCL fills it, a list per input"
                " (fut.wait()[0][rank]); gloo's future holds the gathered tensors themselves, so the hook fails in"
                " its first step (IndexError: \"invalid index of a 0-dim tensor\" per tensor, \"too many indices"
                " for tensor of dimension 2\" per channel)")
# PowerSGD runs vanilla all-reduce for its first steps (start_powerSGD_iter; 2 is the smallest
# value it accepts) and allocates its error-feedback state in the first compressed step:
# a PowerSGD cell's warm-up must include that step, or the memory step measures a one-off.
POWERSGD_START_ITER = 2


def needs_single_bucket(compression: str, backend: str) -> bool:
    return compression == "powersgd" and backend == "gloo"


def register(ddp_model: DistributedDataParallel, compression: str, powersgd_rank: int, seed: int) -> None:
    if compression == "none":
        return
    # Here, not at the top: harness.config reads NAMES and POWERSGD_START_ITER without torch.
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, quantization_hooks

    from harness.features import sparsification

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
    elif compression == "int8_tensor":
        ddp_model.register_comm_hook(None, quantization_hooks.quantization_pertensor_hook)
    elif compression == "int8_channel":
        ddp_model.register_comm_hook(None, quantization_hooks.quantization_perchannel_hook)
    elif compression in ("topk", "randomk"):
        selection: sparsification.Selection = "topk" if compression == "topk" else "randomk"
        ddp_model.register_comm_hook(
            sparsification.SparsificationState(selection=selection, seed=seed, world_size=dist.get_world_size()),
            sparsification.hook)
    else:
        raise ValueError(f"compression={compression!r}: choose one of {', '.join(NAMES)}")
