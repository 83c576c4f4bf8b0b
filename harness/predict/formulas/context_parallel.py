"""Context parallelism: ring attention's K/V traffic as torch runs it."""

from __future__ import annotations


def context_parallel_kv_bytes(batch: int, seq: int, kv_width: int, layers: int, degree: int, *,
                              value_bytes: float = 4, recomputed_per_layer: int = 0) -> dict[str, float]:
    """Bytes per rank per forward + backward of ring attention (Liu et al. 2023, Ring Attention
    with Blockwise Transformers) over ``degree`` ranks as torch implements it
    (torch/distributed/tensor/experimental/_context_parallel/_attention.py, torch 2.13, its
    default rotate method "allgather"): per attention layer the forward all-gathers the
    ranks' K and V once (``_AllGatherRotater``: the gathered output is 2·b·s·kv_width values
    in K and V's dtype), the backward all-gathers them again and passes the fp32 K and V
    gradients (convert_to_f32) round the ring with one all-to-all per ring step
    (``_AllToAllRotater``: ``degree`` × 2·b·(s/degree)·kv_width·4 bytes of input). A
    recomputed forward repeats its all-gather. Nothing at degree 1."""
    if degree == 1:
        return {}
    kv = 2 * batch * seq * kv_width
    return {"all_gather": layers * (2 + recomputed_per_layer) * kv * value_bytes, "all_to_all": layers * kv * 4.0}
