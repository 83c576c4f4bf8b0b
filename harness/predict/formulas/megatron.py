"""Megatron-core's GPTModel, its DDP and distributed optimizer: ZeRO-1 model states, the
tensor-parallel all-reduces of its vocabulary-parallel layers, the optimizer's traffic."""

from __future__ import annotations

from .tensor_parallel import tp_all_reduce_bytes
from .zero import FP32_ADAM, ModelStates, zero_model_states


def megatron_model_states(local_params: float, dp: int) -> ModelStates:
    """Bytes per rank of fp32 training under Megatron's DDP and distributed optimizer, for
    the ``local_params`` a rank holds (its tensor-parallel share of its pipeline stage): the
    fp32 parameter and gradient buffers are whole on every data-parallel rank, the
    optimizer's two Adam moments are sharded over the dp ranks, and the fp32 parameters
    serve as the main copy (no master weights): ZeRO-1, 4 + 4 + 8/N_d bytes per parameter
    (Rajbhandari et al. 2020, §5)."""
    return zero_model_states(local_params, dp, 1, **FP32_ADAM)


def megatron_tp_all_reduce_bytes(batch: int, seq: int, hidden: int, layers: int, tp: int, *, embeds: bool = True,
                                 head: bool = True, value_bytes: float = 4, recomputed_per_block: int = 0) -> float:
    """Bytes a rank all-reduces over its tensor-parallel group per forward + backward of one
    micro-batch through its ``layers`` (no sequence parallelism), after Shoeybi et al. 2019,
    §3 (the blocks' f and g operators; the vocabulary-parallel embedding; the output layer
    fused with the cross entropy, which reduces b·s scalars, not b·s·V logits): the blocks' four
    all-reduces of b·s·h (``tp_all_reduce_bytes``); on the stage that ``embeds``, the
    vocabulary-parallel embedding's forward all-reduce (b·s·h); on the one with the ``head``,
    the output layer's backward all-reduce of its input gradient (b·s·h) and the
    vocabulary-parallel cross entropy's three fp32 all-reduces of b·s values (the max logit,
    the target's logit, the sum of exponentials), which Megatron issues even at tp = 1 (the
    others it skips there). Megatron's full recompute reruns a whole layer
    (``recomputed_per_block=2``)."""
    activation = batch * seq * hidden * value_bytes
    split = tp_all_reduce_bytes(batch, seq, hidden, layers, forward_bytes=value_bytes, backward_bytes=value_bytes,
                                recomputed_per_block=recomputed_per_block) + activation * (embeds + head)
    return (split if tp > 1 else 0.0) + (3 * batch * seq * 4 if head else 0.0)


def megatron_optimizer_comm_bytes(local_params: float) -> dict[str, float]:
    """The distributed optimizer's traffic per step over the data-parallel group: DDP
    reduce-scatters the fp32 gradient buffer (grad_reduce_in_fp32) and, after the step,
    all-gathers the updated fp32 parameter buffer; in the harness's convention each counts
    the whole buffer, 4 bytes per local parameter (Rajbhandari et al. 2020, §7's 2Ψ). Megatron issues both at a
    data-parallel size of 1 too."""
    return {"reduce_scatter": 4.0 * local_params, "all_gather": 4.0 * local_params}
