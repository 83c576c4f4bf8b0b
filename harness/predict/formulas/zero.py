"""ZeRO's model states and communication volume per rank (Rajbhandari et al. 2020)."""

from __future__ import annotations

from dataclasses import dataclass

# zero_model_states defaults to mixed-precision Adam (ZeRO §3.1): fp16 parameters and
# gradients, K = 12 bytes of optimizer state per parameter (fp32 master weights, momentum,
# variance). Pure fp32 Adam: 4 + 4 + 8 bytes (two fp32 moments, no master copy) — also 16 per parameter.
FP32_ADAM = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    """Bytes per rank of each kind of model state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def zero_model_states(n_params: float, world_size: int, stage: int, *, param_bytes: float = 2,
                      grad_bytes: float = 2, optimizer_bytes: float = 12) -> ModelStates:
    """Model-state bytes per rank under ZeRO stage 0 (plain data parallelism) to 3.

    Rajbhandari et al. 2020, §5 and Table 1: P_os (stage 1) shards the optimizer state,
    P_os+g (stage 2) also the gradients, P_os+g+p (stage 3) also the parameters:
    baseline (2 + 2 + K)Ψ; P_os 2Ψ + 2Ψ + KΨ/N_d; P_os+g 2Ψ + (2 + K)Ψ/N_d;
    P_os+g+p (2 + 2 + K)Ψ/N_d (with the mixed-precision byte counts as defaults).
    """
    _check_stage(stage)
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be at least 1")
    shard = 1 / world_size
    return ModelStates(
        params=n_params * param_bytes * (shard if stage >= 3 else 1),
        grads=n_params * grad_bytes * (shard if stage >= 2 else 1),
        optimizer=n_params * optimizer_bytes * (shard if stage >= 1 else 1),
    )


def zero_comm_elements(n_params: float, stage: int) -> float:
    """Elements each rank sends and receives per step (Rajbhandari et al. 2020, §7): data
    parallelism's all-reduce moves 2Ψ (a reduce-scatter and an all-gather of Ψ each); stages 1
    and 2 the same 2Ψ; stage 3 3Ψ (parameters all-gathered in forward and again in backward,
    gradients reduce-scattered), i.e. 1.5× data parallelism."""
    _check_stage(stage)
    return 3 * n_params if stage == 3 else 2 * n_params


def comm_volume(by_op: dict[str, float]) -> float:
    """Bytes each rank moves, in Rajbhandari et al. 2020 §7's convention: an all-reduce
    counts twice (its reduce-scatter and all-gather halves), the others once."""
    return sum(nbytes * (2 if op == "all_reduce" else 1) for op, nbytes in by_op.items())


def _check_stage(stage: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={stage}: choose 0, 1, 2 or 3")
