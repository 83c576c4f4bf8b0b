"""The pytest markers of a cell, and the catalogue pytest registers (--strict-markers).

One marker per axis value (``fsdp_full``, ``bf16``, ``ckpt_selective``, ``accum4`` …) plus
family markers (``fsdp``, ``fsdp1``), so ``-m "fsdp and bf16"`` selects what a user expects.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import get_args

from _pytest.mark.expression import Expression  # pytest's own -m / -k grammar

from harness import strategies
from harness.config import Attention, CellSpec, Checkpointing, Compression, DataSource, Optimizer, Precision
from harness.models.spec import Family

MODEL_FAMILIES: tuple[str, ...] = get_args(Family)  # hf_config: a transformers config.json
ACCUMULATION_MARKERS = (1, 2, 4, 8)
# The world sizes a run can form: powers of two, and whole nodes of 8 GPUs, up to 1,024 ranks.
WORLD_SIZE_MARKERS = tuple(sorted({2**k for k in range(11)} | set(range(8, 1025, 8))))

CATALOGUE: dict[str, str] = {
    **{name: f"strategy {name}" for name in strategies.names()},
    "reference": "the single-process reference run",
    "fsdp": "any FSDP2 (fully_shard) strategy",
    "fsdp1": "any FSDP1 (FullyShardedDataParallel) strategy",
    "deepspeed": "any DeepSpeed engine strategy",
    "fairscale": "any FairScale strategy",
    "zero1": "ZeRO stage 1 in any engine (torch ZeroRedundancyOptimizer, DeepSpeed, FairScale OSS)",
    "zero2": "ZeRO stage 2 in any engine (optimizer state and gradients sharded)",
    "zero3": "ZeRO stage 3 in any engine (optimizer state, gradients and parameters sharded)",
    "tp": "tensor parallel, alone or in a mesh (strategies tp, tp_fsdp, megatron with tp_degree > 1)",
    "pp": "any pipeline-parallel strategy (GPipe, 1F1B, interleaved 1F1B, megatron with pp_degree > 1)",
    "ep": "expert parallel (a mixture-of-experts model's experts split over the ranks)",
    **{f"attn_{a}": f"attention implementation {a}" for a in get_args(Attention)},
    "mha": "multi-head attention (as many key/value heads as query heads)",
    "gqa": "grouped-query attention (fewer key/value heads than query heads, more than one)",
    "mqa": "multi-query attention (one key/value head)",
    "alloc_expandable": "CUDA caching allocator with expandable segments",
    "alloc_max_split": "CUDA caching allocator: blocks above max_split_size_mb never split",
    "alloc_gc": "CUDA caching allocator: cached blocks reclaimed at garbage_collection_threshold",
    "empty_cache": "torch.cuda.empty_cache() after every optimizer step or micro-step",
    "linear_time": "a sequence model without attention (state-space or recurrent: Mamba, RWKV), linear in length",
    "router_aux_loss": "a mixture of experts trained with the router's load-balancing loss (router_aux_loss_coef)",
    "clip": "gradients clipped by their global norm (clip_grad_norm)",
    "scale_none": "fp16 without loss scaling (loss_scaling = \"none\")",
    "syncbn": "BatchNorm statistics over the data-parallel group (SyncBatchNorm)",
    "local_sgd": "local SGD: parameters averaged every local_sgd_period steps (PostLocalSGDOptimizer)",
    "bucket_cap": "DDP's gradient bucket size set (bucket_cap_mb)",
    "gabv": "DDP's buckets as the gradients' storage (gradient_as_bucket_view)",
    "prefetch": "FSDP2's explicit prefetch of the next blocks (prefetch)",
    "overlap_comm": "DeepSpeed's overlap_comm set on or off",
    "ckpt_partial": "activation checkpointing of some blocks only (checkpoint_every, checkpoint_blocks)",
    "fp32_blocks": "the listed blocks computed in fp32 under bf16 or fp16 (fp32_blocks)",
    "offload_blocks": "the listed blocks' parameters, gradients and optimizer state in host memory (offload_blocks)",
    "opt_in_backward": "the optimizer applied in backward, each parameter as its gradient is accumulated",
    "sequence_parallel": "tensor parallel with the norms and residual stream split along the sequence",
    "loss_parallel": "tensor parallel with the embedding, LM head and cross-entropy split by vocabulary",
    **{f"data_{d}": f"training data: {d}" for d in get_args(DataSource)},
    **{p: f"precision {p}" for p in get_args(Precision)},
    **{f"ckpt_{c}": f"activation checkpointing: {c}" for c in get_args(Checkpointing)},
    **{f"offload_{o}": f"offload: {o}" for o in ("none", "params", "optimizer")},
    **{o: f"optimizer {o}" for o in get_args(Optimizer)},
    **{f"accum{n}": f"gradient accumulation over {n} micro-steps" for n in ACCUMULATION_MARKERS},
    **{f"compress_{c}": f"gradient compression: {c}" for c in get_args(Compression)},
    **{f"ws{n}": f"world size {n}" for n in WORLD_SIZE_MARKERS},
    **{family: f"model family {family}" for family in MODEL_FAMILIES},
}

# Markers of tests that are not cells: every cell carries one marker per axis value above,
# these mark whole test files (suites/claims/: one test per published claim).
TEST_MARKERS: dict[str, str] = {
    "claims": "a published claim re-derived from its formula and, where the host can, measured (--suite claims)",
}


def markers_of(cell: CellSpec) -> list[str]:
    s = cell.strategy
    declared = strategies.get(s.name)
    spec = cell.model_spec
    family = spec.family
    # "optimizer_params" offloads both: it carries both markers.
    offload = ["none"] if s.offload == "none" else s.offload.split("_")
    marks = [
        s.name,
        *declared.families,
        *declared.layout_families(s),
        *([declared.zero_idea] if declared.zero_idea else []),
        s.precision,
        f"ckpt_{s.checkpointing}",
        *(f"offload_{o}" for o in offload),
        s.optimizer,
        f"accum{s.accumulation}",
        f"compress_{s.compression}",
        f"ws{cell.world_size}",
        family,
        *([f"attn_{cell.attention}", _attention_heads(spec)] if spec.has_attention else []),
        *(["alloc_expandable"] if cell.expandable_segments else []),
        *(["alloc_max_split"] if cell.max_split_size_mb is not None else []),
        *(["alloc_gc"] if cell.garbage_collection_threshold is not None else []),
        *(["empty_cache"] if cell.empty_cache != "never" else []),
        *(["router_aux_loss"] if cell.router_aux_loss_coef is not None else []),
        *(["linear_time"] if spec.task == "causal_lm" and not spec.has_attention else []),
        *(["clip"] if s.clip_grad_norm is not None else []),
        *([f"scale_{s.loss_scaling}"] if s.loss_scaling != "dynamic" else []),
        *(["syncbn"] if s.sync_batch_norm else []),
        *(["local_sgd"] if s.local_sgd_period is not None else []),
        *(["bucket_cap"] if s.bucket_cap_mb is not None else []),
        *(["gabv"] if s.gradient_as_bucket_view else []),
        *(["prefetch"] if s.prefetch is not None else []),
        *(["overlap_comm"] if s.overlap_comm is not None else []),
        *(["opt_in_backward"] if s.optimizer_in_backward else []),
        *(["sequence_parallel"] if s.sequence_parallel else []),
        *(["loss_parallel"] if s.loss_parallel else []),
        *(["ckpt_partial"] if s.checkpoint_every or s.checkpoint_blocks else []),
        *(["fp32_blocks"] if s.fp32_blocks else []),
        *(["offload_blocks"] if s.offload_blocks else []),
        f"data_{cell.data}",
    ]
    unknown = [m for m in marks if m not in CATALOGUE]
    if unknown:
        raise ValueError(f"cell {cell.cell_id} has unregistered markers {unknown}")
    return list(dict.fromkeys(marks))  # de-duplicated, order kept (zero1 is its own idea)


def _attention_heads(spec) -> str:
    if spec.kv_heads == spec.n_heads:
        return "mha"
    return "mqa" if spec.kv_heads == 1 else "gqa"


_KEYWORDS = {"and", "or", "not"}


def check_marker_expression(expr: str, cells: list[CellSpec] | None = None) -> None:
    """Refuse a ``-m`` expression pytest cannot parse, naming a marker that does not exist, or
    selecting none of ``cells`` (the suite's, where given).

    pytest would silently select nothing for ``-m zero4``, or fail with its own output after
    collecting for ``-m "fsdp and ("``; a benchmark run that measures nothing because of a
    typo wastes a cluster allocation.
    """
    compiled = _compiled("-m", expr)
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr)) - _KEYWORDS
    known = CATALOGUE.keys() | TEST_MARKERS.keys()
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(
            f"unknown marker(s) {', '.join(unknown)} in -m {expr!r}: "
            f"choose from {', '.join(sorted(known))}"
        )
    if cells is None or names & TEST_MARKERS.keys():
        return  # no cells to hold it against, or it selects tests beside the cells (the claims)
    if not any(compiled.evaluate(_among(set(markers_of(cell)))) for cell in cells):
        raise ValueError(f"-m {expr!r} selects none of the suite's {len(cells)} cells: `python -m harness list"
                         f" --suite ...` shows each cell's markers")


def check_world_sizes(cells: list[CellSpec]) -> None:
    """Refuse a cell whose world size no marker names (pytest's --strict-markers would fail
    the whole collection on it)."""
    odd = sorted({c.world_size for c in cells} - set(WORLD_SIZE_MARKERS))
    if odd:
        raise ValueError(f"world_size {', '.join(map(str, odd))}: the suites form world sizes that are powers of"
                         f" two or multiples of 8, up to {WORLD_SIZE_MARKERS[-1]} (ws markers)")


def check_keyword_expression(expr: str) -> None:
    """Refuse a ``-k`` expression pytest cannot parse (its names are substrings of the test
    ids: any is allowed)."""
    _compiled("-k", expr)


def _compiled(flag: str, expr: str) -> Expression:
    """pytest's own parse of a selection expression, its error as one line."""
    try:
        return Expression.compile(expr)
    except SyntaxError as error:
        raise ValueError(f"{flag} {expr!r}: not a valid expression at column {error.offset}: {error.msg}") from None


def _among(names: set[str]) -> Callable[..., bool]:
    return lambda name, **_: name in names
