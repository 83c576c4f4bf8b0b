"""Tensor parallelism's model states and all-reduces (Shoeybi et al. 2019, Megatron-LM)."""

from __future__ import annotations

from .zero import ModelStates


def tp_model_states(sharded: float, replicated: float, tp: int, *, data_parallel: int = 1, param_bytes: float = 4,
                    grad_bytes: float = 4, optimizer_bytes: float = 8) -> ModelStates:
    """Model-state bytes per rank under tensor parallelism (Shoeybi et al. 2019, Megatron-LM
    §3): the column- and row-parallel linear layers' ``sharded`` parameters are split over the
    ``tp`` ranks of a group, the rest (LayerNorms, row-parallel biases, embeddings unless
    vocabulary-parallel) is ``replicated`` on each; every state follows its parameter.
    ``data_parallel=N_d`` then shards each rank's part over N_d ranks, as FSDP / ZeRO-3 does
    (2-D TP × FSDP, torchtitan): (sharded/t + replicated)·(2 + 2 + K)/N_d in ZeRO's terms.
    Defaults: fp32 AdamW, 4 + 4 + 8 bytes per parameter."""
    if tp < 1 or data_parallel < 1:
        raise ValueError(f"tp={tp}, data_parallel={data_parallel}: both must be at least 1")
    local = (sharded / tp + replicated) / data_parallel
    return ModelStates(params=local * param_bytes, grads=local * grad_bytes, optimizer=local * optimizer_bytes)


def tp_all_reduce_bytes(batch: int, seq: int, hidden: int, layers: int, *, forward_bytes: float = 4,
                        backward_bytes: float = 4, recomputed_per_block: int = 0) -> float:
    """Bytes all-reduced per rank per forward + backward under Megatron tensor parallelism
    (Shoeybi et al. 2019, §3, Fig. 4): each transformer block has two all-reduces in forward
    (the g operator after the attention's row-parallel output projection and after the MLP's
    row-parallel second linear) and two in backward (the f operator before the column-parallel
    QKV and first MLP linear), each of the b·s·h activation: 4·L·b·s·h values.

    The two directions can differ in width (under autocast the forward's are in the compute
    dtype, the backward's in the dtype of the block's input), and a recomputed forward
    repeats the all-reduces it reaches (``recomputed_per_block``)."""
    values = layers * batch * seq * hidden
    return values * ((2 + recomputed_per_block) * forward_bytes + 2 * backward_bytes)
