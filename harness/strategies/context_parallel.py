"""Context parallel: every rank takes the same samples, each rank a slice of their sequence
(torch.distributed.tensor.experimental.context_parallel: ring attention over the ranks).

The sequence dimension of the step's input ids, targets and position ids is sharded with
torch's head-tail load balancer (causal attention: rank r takes chunks r and 2W-1-r of 2W, so
every rank does the same attention work), and F.scaled_dot_product_attention is replaced by
its ring version inside the context. Forward and backward both run in it (the ring backward
is dispatched there), so the strategy owns them: ``Prepared.forward_backward``. Parameters
are replicated and wrapped in DDP, which averages the ranks' gradients.

Loss: HF shifts labels inside the model, which a sequence shard cannot do (a shard's last
token's target lives on another rank). The targets are shifted on the whole sequence before
sharding (the last position gets ignore_index), each rank sums its tokens' cross-entropy, and
scales by W / (tokens in the whole batch): DDP's average of the ranks' gradients is then the
gradient of the global mean, and the worker's mean over ranks of their losses is the global
mean loss (HF's definition).

HF's mask: explicit position ids that jump (load-balanced shards do) make transformers build
a packed-sequence mask, which the ring attention refuses ("attn_bias is not supported yet").
An all-ones 2-D attention mask instead lets it skip the mask and call SDPA with is_causal=True.

Why not on the CPU (torch 2.13, torch/distributed/tensor/experimental/_context_parallel/
_attention.py): the ring attention handles only the CUDA SDPA kernels
(aten._scaled_dot_product_{flash,efficient,cudnn}_attention and their backwards, the
``custom_ops`` of ``_sdpa_handler``). On the CPU, SDPA dispatches to
aten._scaled_dot_product_flash_attention_for_cpu, for which DTensor has no sharding strategy
(seen with 2 gloo ranks: "Operator aten._scaled_dot_product_flash_attention_for_cpu.default
does not have a sharding strategy registered"); the math backend fails on mixing Tensor and
DTensor. Gloo itself is not the obstacle: the ring's collectives are all-gathers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

from harness import distributed
from harness.features import optimizers
from harness.models import sources
from harness.strategies.base import RECOMPUTE_CHECKPOINTING, Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from harness.config import CellSpec
    from harness.distributed import DistEnv

IGNORE_INDEX = -100  # torch's cross_entropy default, as HF's loss
# The kernels the ring attention has versions of; without this SDPA may pick the math
# backend, which context parallel refuses.
RING_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

CAPABILITIES = Capabilities(
    precisions=frozenset({"fp32", "bf16"}),
    checkpointing=RECOMPUTE_CHECKPOINTING,
    evaluation=False,
    optimizers=frozenset(optimizers.NAMES),
    notes={"evaluation": "its forward shards the sequence inside the context-parallel step: no held-out evaluation",
           "fp16": "fp16 needs the GradScaler inside the context-parallel forward/backward: not wired"},
)

CPU_REASON = (
    "context parallel's ring attention (torch.distributed.tensor.experimental.context_parallel) handles only"
    " the CUDA SDPA kernels (flash, memory-efficient, cuDNN); on the CPU SDPA dispatches to"
    " aten._scaled_dot_product_flash_attention_for_cpu, which has no DTensor sharding strategy"
)


def unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    return CPU_REASON if device_type != "cuda" else None


def combination_problem(cell: CellSpec) -> str | None:
    spec = cell.model_spec
    if spec.layout != "llama":
        return f"model {cell.model_name}: context parallel is wired for the llama layout only (harness/models/spec.py)"
    if cell.attention != "sdpa":
        # Any other attention would run on the local shard alone: a silent wrong answer.
        return f"attention={cell.attention}: context parallel replaces SDPA, so it needs attention='sdpa'"
    if (window := sources.window_passed(spec)) is not None:
        return (f"model {cell.model_name}: its attention is masked to a {window}-token sliding window, which"
                f" {spec.tokens_per_sample} tokens pass; the ring attention takes the causal flag alone, no mask")
    if spec.required("seq_len") % (2 * cell.world_size):
        return (f"model {cell.model_name}: seq_len={spec.seq_len} must be divisible by 2 x world_size ="
                f" {2 * cell.world_size} (the causal load balancer cuts it into 2W chunks)")
    return None


def _shifted_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Each position's next token, on the whole sequence; the last position has none."""
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[:, :-1] = input_ids[:, 1:]
    return targets


class ContextParallelStep:
    """Forward and backward of one micro-step with the sequence sharded over the ranks."""

    def __init__(self, model: nn.Module, cell: CellSpec, env: DistEnv):
        self.model = model
        self.mesh = distributed.mesh(env.device.type, (env.world_size,), ("cp",))
        self.world_size = env.world_size
        self.accumulation = cell.strategy.accumulation

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        input_ids = batch["input_ids"].clone()  # sharded in place: keep the step's batch intact
        n_tokens = input_ids.shape[0] * (input_ids.shape[1] - 1)  # predicted tokens in the whole batch
        targets = _shifted_targets(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids).contiguous()
        buffers = [input_ids, targets, positions]
        # Imported here: torch.distributed.tensor.experimental costs every launch a third of a
        # second, and only this strategy's step needs it.
        from torch.distributed.tensor.experimental import context_parallel

        with sdpa_kernel(RING_BACKENDS), context_parallel(
                self.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            logits = self.model(input_ids=input_ids, position_ids=positions,
                                attention_mask=torch.ones_like(input_ids)).logits
            loss_sum = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                       ignore_index=IGNORE_INDEX, reduction="sum")
            loss = loss_sum * self.world_size / (n_tokens * self.accumulation)
            loss.backward()
        return loss.detach()


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    ddp_model = DistributedDataParallel(model.to(env.device), device_ids=[env.device.index] if env.is_cuda else None)
    return Prepared(
        model=ddp_model,
        optimizer=optimizers.make(ddp_model.parameters(), cell.strategy.optimizer, cell.lr),
        no_sync=ddp_model.no_sync,
        forward_backward=ContextParallelStep(ddp_model, cell, env),
        data_rank=0,  # every rank takes the same samples: the sequence is split, not the batch
    )


STRATEGIES = (
    Strategy(
        name="cp", summary="torch's context parallel: ring attention over the sequence split (CUDA only)",
        engine="torch", splits_batch=False, capabilities=CAPABILITIES, combination_problem=combination_problem,
        unsupported_reason=unsupported_reason, engine_model=EngineModel(analytic="context_parallel"),
        prepare=prepare,
    ),
)
