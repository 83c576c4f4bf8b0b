"""The named matrices. A suite is a function of the world size that returns cells; the
pytest files in suites/ parametrise over it, one test per cell.

- smoke: a handful of fast cells (run by ./run_tests.sh and CI).
- default: every axis value at least once, for one GPT-2 and one LLaMA preset, plus BERT,
  ViT, the MLP and a model from a transformers config.json (what ./run_all.sh runs when asked
  nothing). On GPUs, real sizes instead: harness/suites_gpu.py, for the GPUs' count and memory.
- full: the product of strategies × {fp32, bf16} × checkpointing × accumulation {1, 4} over
  the tiny GPT-2 and LLaMA presets, where the strategy supports the combination, and the
  cells the default suite left out for its time (``beyond_default``).
- real: real sizes on a CPU host: gpt2-124m and a LLaMA-style ~100M model (suites/configs/
  llama-100m.json) at seq_len 256 over the data-parallel and sharding strategies of torch and
  DeepSpeed, with full-checkpointing and bf16 variants. On a CPU without bf16 arithmetic (no
  AVX512-BF16 or AMX, as this project's 2-core hosts) the bf16 cells are recorded
  ``unsupported`` with the measured rates: emulated, one step would take minutes.
- perf: no matrix; the benchmarks of the harness itself in suites/test_perf.py (its step
  overhead against a bare training loop, launch amortisation, the default suite's wall time).
- claims: the cells the published claims need (suites/claims/, harness/claims/): one test
  per claim, not per cell.
- a path ending in .toml: a suite of one's own (harness/suite_files.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import convergence as convergence_verdicts
from harness import strategies, suite_files, suites_gpu
from harness.claims import catalogue as claims_catalogue
from harness.config import TRAIN_SAMPLES, CellSpec, StrategySpec
from harness.models import ModelSpec, sources
from harness.suite_cell import MICRO_BATCH, suite_cell

# Suite files to start one's own from (README: Suites of your own).
SUITE_FILE_EXAMPLES = Path(__file__).resolve().parents[1] / "suites" / "examples"
# transformers config.json files the suites train (README: Models).
# torch's own data-parallel and sharded strategies, the reference first.
TORCH_NATIVE = tuple(s.name for s in strategies.declarations()
                     if s.engine == "torch" and s.engine_model.analytic == "data_parallel")


def _cell(model: str | ModelSpec, strategy: str, world_size: int, **options) -> CellSpec:
    return suite_cell(model, StrategySpec(name=strategy, **options), world_size)


def _with_reference(cell: CellSpec) -> list[CellSpec]:
    """A cell and the reference it is gated against (for strategies whose ranks share samples,
    the reference is not the suite's usual whole-batch ``single`` cell)."""
    return [cell.reference(), cell]


def smoke(world_size: int) -> list[CellSpec]:
    return [
        _cell("gpt2-tiny", "single", world_size),
        _cell("gpt2-tiny", "ddp", world_size),
        _cell("gpt2-tiny", "fsdp_full", world_size),
        _cell("llama-tiny", "zero1", world_size, precision="bf16"),
        _cell("gpt2-tiny", "ddp", world_size, compression="bf16"),  # an `unsupported` on CPU
    ]


# Below the tiny GPT-2's gradient norms (1.2-2.6 over its first 10 steps): every step clips.
CLIP_GRAD_NORM = 0.5
CLIP_LR = 0.1


def default(world_size: int) -> list[CellSpec]:
    cells = []
    # Every torch-native strategy, fp32, on GPT-2; the common ones on LLaMA.
    cells += [_cell("gpt2-tiny", s, world_size) for s in TORCH_NATIVE]
    cells += [_cell("llama-tiny", s, world_size) for s in ("single", "ddp", "fsdp_full")]
    # Precision.
    cells += [_cell("gpt2-tiny", s, world_size, precision="bf16") for s in ("single", "ddp", "fsdp_full", "fsdp1_full")]
    cells += [_cell("llama-tiny", s, world_size, precision="bf16") for s in ("single", "fsdp_grad_op")]
    # fp16 runs 10-15x slower on a CPU without fp16 units: one model only. Each engine's loss
    # scaler: torch's GradScaler (DDP), its ShardedGradScaler (both FSDPs), FairScale's (SDP)
    # and DeepSpeed's own; the last two are recorded unsupported, with the reason, on a CPU.
    cells += [_cell("gpt2-tiny", s, world_size, precision="fp16")
              for s in ("single", "ddp", "fsdp_full", "fsdp1_full", "fairscale_sdp",
                        "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")]
    # Gradient clipping, each engine's way, gated against a reference that clips too; under
    # fp16 after unscale_. With SGD at a step size where clipping shows in the losses (AdamW's
    # update hardly depends on the gradients' scale: clipping moved its 10-step losses by 1.6e-4,
    # under the fp16 gate).
    cells += [suite_cell("gpt2-tiny", StrategySpec(name=s, optimizer="sgd", clip_grad_norm=CLIP_GRAD_NORM),
                         world_size, lr=CLIP_LR)
              for s in ("single", "ddp", "fsdp_full", "fsdp1_full", "fairscale_oss", "deepspeed_zero2")]
    cells += [suite_cell("gpt2-tiny", StrategySpec(name=s, precision="fp16", optimizer="sgd",
                                                   clip_grad_norm=CLIP_GRAD_NORM), world_size, lr=CLIP_LR)
              for s in ("single", "ddp")]
    # fp16 without loss scaling; real text through each rank's DistributedSampler and
    # DataLoader, with its held-out loss (the convergence suite trains on it for 200 steps).
    cells += [_cell("gpt2-tiny", s, world_size, precision="fp16", loss_scaling="none") for s in ("single", "ddp")]
    if TRAIN_SAMPLES["stdlib_bytes"] % (MICRO_BATCH * world_size) == 0:  # whole global batches an epoch
        cells += [suite_cell("gpt2-bytes", StrategySpec(name=s), world_size, data="stdlib_bytes", eval_every=5)
                  for s in ("single", "ddp")]
    # BatchNorm on the digits: DDP normalising per rank (not gated: measure/batch_norm.py) and
    # with SyncBatchNorm (unsupported on CPU), beside the whole-batch run.
    if TRAIN_SAMPLES["digits"] % (MICRO_BATCH * world_size) == 0:
        cells += [suite_cell("convnet-digits", StrategySpec(name=s, sync_batch_norm=sync), world_size, data="digits",
                             eval_every=5)
                  for s, sync in (("single", False), ("ddp", False), ("ddp", True))]
    # Activation checkpointing.
    cells += [
        _cell("gpt2-tiny", "ddp", world_size, checkpointing="full"),
        _cell("gpt2-tiny", "fsdp_full", world_size, checkpointing="full"),
        _cell("llama-tiny", "fsdp_full", world_size, checkpointing="selective"),
        _cell("gpt2-tiny", "single", world_size, checkpointing="selective"),
    ]
    # Checkpointing every other block of the 4-block byte-level GPT-2 (its activations between
    # none and all: the claim activations/checkpoint_every_linear).
    cells.append(_cell("gpt2-bytes", "ddp", world_size, checkpointing="full", checkpoint_every=2))
    # Per-layer options: a listed set of blocks checkpointed (the first and last); the first
    # block in fp32 under bf16, by autocast (DDP) and by FSDP2's per-module policy; one block's
    # states in host memory (FSDP2's per-module offload).
    cells += [_cell("gpt2-bytes", "ddp", world_size, checkpointing="full", checkpoint_blocks="0,3"),
              *(_cell("llama-tiny", s, world_size, precision="bf16", fp32_blocks="0")
                for s in ("single", "ddp", "fsdp_full")),
              _cell("gpt2-tiny", "fsdp_full", world_size, offload_blocks="1")]
    # Activation offload instead of recompute (CUDA: unsupported here, with the reason).
    cells.append(_cell("gpt2-tiny", "ddp", world_size, checkpointing="offload"))
    # Offload.
    cells += [_cell("gpt2-tiny", s, world_size, offload="params") for s in ("fsdp_full", "fsdp1_full")]
    # Gradient accumulation.
    cells += [_cell("gpt2-tiny", s, world_size, accumulation=4) for s in ("ddp", "fsdp_full", "fsdp1_full")]
    # Gradient compression.
    cells += [
        _cell("gpt2-tiny", "ddp", world_size, compression="fp16"),
        _cell("gpt2-tiny", "ddp", world_size, compression="bf16"),
        _cell("gpt2-tiny", "ddp", world_size, compression="powersgd", powersgd_rank=1),
        _cell("gpt2-tiny", "ddp", world_size, compression="powersgd", powersgd_rank=4),
        # Quantization (unsupported on gloo, with the measured reason) and sparsification with
        # error feedback: not gated, judged in the convergence suite.
        _cell("gpt2-tiny", "ddp", world_size, compression="int8_tensor"),
        _cell("gpt2-tiny", "ddp", world_size, compression="int8_channel"),
        _cell("gpt2-tiny", "ddp", world_size, compression="topk"),
        _cell("gpt2-tiny", "ddp", world_size, compression="randomk"),
    ]
    # Local SGD: parameters averaged every 4 steps, nothing sent between (not gated either).
    cells.append(_cell("gpt2-tiny", "ddp", world_size, local_sgd_period=4))
    # Communication–computation overlap, each engine's knob: DDP's buckets (four of them at
    # 0.1 MiB) and buckets as gradient storage, FSDP2 prefetching two blocks ahead (on the
    # 4-block byte-level GPT-2), DeepSpeed's overlap_comm set against ZeRO-2's default (ZeRO-3's,
    # off against its default on, in `full`).
    cells += [_cell("gpt2-tiny", "ddp", world_size, bucket_cap_mb=0.1, gradient_as_bucket_view=view)
              for view in (False, True)]
    cells += [_cell("gpt2-bytes", s, world_size, **options)
              for s, options in (("single", {}), ("fsdp_full", {"prefetch": 2}))]
    cells.append(_cell("gpt2-tiny", "deepspeed_zero2", world_size, overlap_comm=True))
    # ZeRO-2 accumulating: it reduces every micro-step and holds a partition more (ZeRO-1
    # reduces once, at the boundary).
    cells += [_cell("gpt2-tiny", "deepspeed_zero2", world_size, accumulation=4)]
    # The optimizer applied in backward: one process, and DDP (torch's, unsupported on a CPU).
    cells += [_cell("gpt2-tiny", s, world_size, optimizer_in_backward=True) for s in ("single", "ddp")]
    # DeepSpeed ZeRO-1/2/3 beside torch's and FairScale's takes on the same ideas; its CPU
    # Adam (optimizer offload) is compiled on first use, outside any measured step. LLaMA's
    # layout under ZeRO-3, whose fetches follow the modules; its other stages in `full`.
    in_full = _gpt2_beyond_default(world_size)
    cells += [c for c in _deepspeed("gpt2-tiny", world_size) if c not in in_full]
    cells.append(_cell("llama-tiny", "deepspeed_zero3", world_size))
    # FairScale's ZeRO-1 and ZeRO-2; its FSDP needs CUDA (unsupported here).
    cells += [_cell("gpt2-tiny", s, world_size) for s in ("fairscale_oss", "fairscale_sdp", "fairscale_fsdp")]
    # 8-bit and factored optimizers under DDP and a sharded strategy, each gated against a
    # reference with the same optimizer; paged 8-bit is CUDA-only (unsupported here).
    for optimizer in ("adam8bit", "adamw8bit", "paged_adamw8bit", "adafactor"):
        cells += [_cell("gpt2-tiny", s, world_size, optimizer=optimizer) for s in ("single", "ddp")]
    cells += [_cell("gpt2-tiny", "fairscale_sdp", world_size, optimizer=o) for o in ("adamw8bit", "adafactor")]
    cells += [_cell("gpt2-tiny", s, world_size, optimizer="adamw8bit") for s in ("fsdp1_full", "deepspeed_zero2")]
    # LAMB (bitsandbytes, 32-bit and 8-bit) where the optimizer steps whole tensors: DDP and
    # torch's ZeRO-1 (its per-tensor trust ratio refuses flat and DTensor shards).
    cells += [_cell("gpt2-tiny", s, world_size, optimizer="lamb") for s in ("single", "ddp")]
    cells += [_cell("gpt2-tiny", s, world_size, optimizer="lamb8bit") for s in ("single", "zero1")]
    # DeepSpeed's fused LAMB, a CUDA kernel (unsupported here), under DDP and its reference.
    cells += [_cell("gpt2-tiny", s, world_size, optimizer="fused_lamb") for s in ("single", "ddp")]
    # The other model families, and a model of one's own: a Mistral config.json.
    others: list[tuple[str | ModelSpec, str]] = [("bert-tiny", "ddp"), ("vit-tiny", "fsdp_full"), ("mlp-tiny", "ddp"),
                                                 (sources.config_model("mistral-tiny"), "fsdp_full")]
    for other, strategy in others:
        cells += [_cell(other, "single", world_size), _cell(other, strategy, world_size)]
    cells += model_parallel(world_size)
    cells += model_structure(world_size)
    return cells


def model_parallel(world_size: int) -> list[CellSpec]:
    """Tensor and pipeline parallelism (and their unsupported relatives on a CPU host). The
    2-layer models split only so far: a cell this world size cannot form (llama-tiny's 2
    key/value heads over 4 ranks, 8 pipeline stages of 2 blocks) is left out, as in ``full``."""
    candidates = [_cell(model, "tp", world_size) for model in ("gpt2-tiny", "llama-tiny")]
    # torchtitan's plan options, the untied table and head split by vocabulary.
    candidates.append(_cell("llama-tiny", "tp", world_size, sequence_parallel=True, loss_parallel=True))
    tp_degree = strategies.get("tp_fsdp").options["tp_degree"]
    if not isinstance(tp_degree, int):
        raise TypeError(f"tp_fsdp declares tp_degree={tp_degree!r}: a degree is an int number of ranks")
    if world_size >= 2 * tp_degree and world_size % tp_degree == 0:  # two data-parallel groups
        candidates.append(_cell("llama-tiny", "tp_fsdp", world_size))
    candidates += [_cell("llama-tiny", schedule, world_size)
                   for schedule in ("pp_gpipe", "pp_1f1b", "pp_interleaved_1f1b")]
    candidates += [
        _cell("gpt2-tiny", "pp_1f1b", world_size),  # the tied head across the first and last stage
        _cell("llama-tiny", "pp_1f1b", world_size, precision="bf16"),
        # Clipping by the norm summed over the stages (the tied table counted once), against the
        # default suite's clipped reference: the same global batch as its data-parallel cells.
        suite_cell("gpt2-tiny", StrategySpec(name="pp_1f1b", optimizer="sgd", clip_grad_norm=CLIP_GRAD_NORM,
                                             pp_microbatches=world_size), world_size, lr=CLIP_LR),
        *_megatron(world_size),
        # bf16: with grouped-query attention in fp32, only the memory-efficient kernel is left
        # to ring attention on CUDA, and whether it takes GQA is not known here.
        _cell("llama-tiny", "cp", world_size, precision="bf16"),
    ]
    return [c for cell in candidates if strategies.incompatibility(cell) is None for c in _with_reference(cell)]


def _megatron(world_size: int) -> list[CellSpec]:
    """Megatron's GPTModel in the layouts this world size forms: tensor parallel over 2 ranks
    (the rest data parallel), and a two-stage pipeline (tensor parallel over 2 ranks where the
    world size divides by 4). Its local layers compute attention unfused: gated against eager
    attention."""
    layouts = [(2, 1), (2 if world_size % 4 == 0 else 1, 2)]  # (tp_degree, pp_degree)
    return [suite_cell("gpt2-tiny", StrategySpec(name="megatron", tp_degree=tp, pp_degree=pp), world_size,
                       attention="eager")
            for tp, pp in layouts if world_size % (tp * pp) == 0]


def model_structure(world_size: int) -> list[CellSpec]:
    """Attention implementations, key/value head counts, mixture of experts (and its router's
    load-balancing loss), a model without attention, allocator settings."""
    cells = []
    cells += [suite_cell("gpt2-tiny", StrategySpec(name=s), world_size, attention="eager") for s in ("single", "ddp")]
    # flash-attn computes in half precision only.
    cells += [suite_cell("gpt2-tiny", StrategySpec(name=s, precision="bf16"), world_size, attention="flash")
              for s in ("single", "ddp")]
    # Key/value heads: every head its own (MHA), one for all (MQA), beside llama-tiny's groups.
    for model in ("llama-tiny-mha", "llama-tiny-mqa"):
        cells += [_cell(model, s, world_size) for s in ("single", "ddp")]
    cells += [_cell("moe-tiny", s, world_size) for s in ("single", "ddp", "fsdp_full")]
    cells += _expert_parallel(world_size)
    # A sequence model without attention (Mamba: its state-space layer is linear in length).
    cells += [_mamba(s, world_size) for s in ("single", "ddp")]
    # The router's load-balancing loss: each rank's is over its own tokens (not gated: the
    # whole-batch single cell is the reference it is shown beside).
    cells += [suite_cell("moe-tiny", StrategySpec(name=s), world_size, router_aux_loss_coef=0.01)
              for s in ("single", "ddp")]
    # The caching allocator's settings and empty_cache (CUDA: unsupported here, with the reason).
    cells += [suite_cell("gpt2-tiny", StrategySpec(name="ddp"), world_size, **allocator) for allocator in (
        {"expandable_segments": True}, {"max_split_size_mb": 128}, {"garbage_collection_threshold": 0.8},
        {"empty_cache": "step"})]
    return cells


def _expert_parallel(world_size: int) -> list[CellSpec]:
    """moe-tiny's experts split over the ranks (gated against its whole-batch ``single``
    cell), with and without checkpointing; none where its experts do not divide evenly."""
    from harness.models.presets import get_preset

    if get_preset("moe-tiny").required("n_experts") % world_size:
        return []
    return [_cell("moe-tiny", "deepspeed_autoep", world_size, checkpointing=c) for c in ("none", "full")]


def _deepspeed(model: str, world_size: int) -> list[CellSpec]:
    """DeepSpeed's three stages in fp32 and bf16, its optimizer and parameter offload, and
    ZeRO-3 checkpointing and accumulating."""
    return [*(_cell(model, f"deepspeed_zero{stage}", world_size, precision=p) for stage in (1, 2, 3)
              for p in ("fp32", "bf16")),
            _cell(model, "deepspeed_zero2", world_size, offload="optimizer"),
            _cell(model, "deepspeed_zero3", world_size, offload="params"),
            _cell(model, "deepspeed_zero3", world_size, checkpointing="full", accumulation=4)]


def _gpt2_beyond_default(world_size: int) -> list[CellSpec]:
    """gpt2-tiny's cells in ``full`` only: ZeRO-1 in bf16 (the default has ZeRO-2's and 3's),
    ZeRO-3 with overlap_comm off (the default sets ZeRO-2's on), FairScale's SDP in bf16 (the
    default has bf16 under five other engines)."""
    return [_cell("gpt2-tiny", "deepspeed_zero1", world_size, precision="bf16"),
            _cell("gpt2-tiny", "deepspeed_zero3", world_size, overlap_comm=False),
            _cell("gpt2-tiny", "fairscale_sdp", world_size, precision="bf16")]


def _mamba(strategy: str, world_size: int) -> CellSpec:
    return suite_cell(sources.config_model("mamba-tiny"), StrategySpec(name=strategy), world_size, seq_len=32)


def beyond_default(world_size: int) -> list[CellSpec]:
    """Cells the default suite leaves out to keep within its time (README: "On a fresh machine"), each
    varying an axis whose value it has at least once on another model or engine, with their
    references: in ``full``."""
    cells = [_cell("llama-tiny", s, world_size) for s in ("zero1", "fsdp1_full", "fairscale_oss", "fairscale_sdp")]
    kept = _cell("llama-tiny", "deepspeed_zero3", world_size)  # in the default suite
    cells += [c for c in _deepspeed("llama-tiny", world_size) if c != kept]
    # SGD with momentum (half AdamW's state; the default's clipping cells step it) under DDP and
    # FSDP2's DTensor shards; 8-bit LAMB under DDP (the default's is under ZeRO-1).
    cells += [_cell("gpt2-tiny", s, world_size, optimizer="sgd") for s in ("single", "ddp", "fsdp_full")]
    cells.append(_cell("gpt2-tiny", "ddp", world_size, optimizer="lamb8bit"))
    cells += [_cell("llama-tiny", s, world_size, optimizer="adam8bit") for s in ("single", "ddp")]
    cells += [suite_cell("llama-tiny", StrategySpec(name=s), world_size, attention="eager") for s in ("single", "ddp")]
    cells += [_cell(model, "fsdp_full", world_size) for model in ("llama-tiny-mha", "llama-tiny-mqa")]
    cells.append(_mamba("fsdp_full", world_size))
    cells += _gpt2_beyond_default(world_size)
    return [c for cell in cells for c in _with_reference(cell)]


def full(world_size: int) -> list[CellSpec]:
    cells = beyond_default(world_size)
    for model, strategy, precision, ckpt, accum in itertools.product(
        ("gpt2-tiny", "llama-tiny"), TORCH_NATIVE, ("fp32", "bf16"), ("none", "full", "selective"), (1, 4)
    ):
        cell = _cell(model, strategy, world_size, precision=precision, checkpointing=ckpt, accumulation=accum)
        if strategies.incompatibility(cell) is None:
            cells.append(cell)
    return cells


# The real suite's sharding strategies, against DDP; its checkpointing variant runs on the
# three that hold the most, the least and DeepSpeed's take on the least.
REAL_STRATEGIES = ("ddp", "zero1", "fsdp_full", "fsdp1_full", "deepspeed_zero2", "deepspeed_zero3")
REAL_VARIANT_STRATEGIES = ("ddp", "fsdp_full", "deepspeed_zero3")
REAL_SEQ_LEN = 256


def real(world_size: int) -> list[CellSpec]:
    """Real sizes a CPU host trains in minutes: one sample per rank at seq_len 256, the fewest
    steps a cell takes (warm-up, the two probes, two timed steps)."""
    def cell(model: str | ModelSpec, strategy: str, **options: Any) -> CellSpec:
        return suite_cell(model, StrategySpec(name=strategy, **options), world_size, micro_batch=1, steps=6,
                          seq_len=REAL_SEQ_LEN)

    cells = []
    for model in ("gpt2-124m", sources.config_model("llama-100m")):
        cells += [cell(model, s) for s in ("single", *REAL_STRATEGIES)]
    cells += [cell(sources.config_model("llama-100m"), s, checkpointing="full") for s in REAL_VARIANT_STRATEGIES]
    # On a CPU without bf16 arithmetic these are recorded unsupported, with the measured rates
    # (runner/timeouts.py, too_slow_reason); they run where the CPU has it (AVX512-BF16, AMX).
    cells += [cell(sources.config_model("llama-100m"), s, precision="bf16") for s in REAL_VARIANT_STRATEGIES]
    return cells


def perf(world_size: int) -> list[CellSpec]:
    return []


CONVERGENCE_PRECISIONS: tuple[dict[str, Any], ...] = (
    {"precision": "fp32"}, {"precision": "bf16"}, {"precision": "fp16"}, {"precision": "fp16", "loss_scaling": "none"})
CONVERGENCE_STRATEGIES = ("single", "ddp", "fsdp_full", "deepspeed_zero2", "deepspeed_zero3")
# BatchNorm on the digits (measure/batch_norm.py): DDP normalising per rank, over the group
# (SyncBatchNorm), and per micro-step of a virtual batch, in one process and in DDP.
BATCH_NORM_CELLS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("ddp", {}), ("ddp", {"sync_batch_norm": True}), ("ddp", {"accumulation": 2}), ("single", {"accumulation": 2}))
# The compression hooks that change the update (features/compression.py UNGATED), PowerSGD and
# local SGD every 4 and 16 steps: their effect on where training ends, DDP in fp32 on text.
CONVERGENCE_COMPRESSIONS: tuple[dict[str, Any], ...] = (
    {"compression": "powersgd"}, {"compression": "int8_tensor"}, {"compression": "int8_channel"},
    {"compression": "topk"}, {"compression": "randomk"}, {"local_sgd_period": 4}, {"local_sgd_period": 16})


def convergence(world_size: int) -> list[CellSpec]:
    """Training on real data (harness/convergence.py: the models, the data, the verdict): on
    text, every strategy of CONVERGENCE_STRATEGIES under fp32, bf16, fp16 with and without loss
    scaling; DDP under each of CONVERGENCE_COMPRESSIONS; on the digits, BATCH_NORM_CELLS in
    fp32; and for both models the fp32 reference under each of convergence_verdicts.SEEDS
    (whose spread is the verdict's tolerance)."""
    cells = [convergence_verdicts.cell("single", world_size, seed=seed, model=model, precision="fp32")
             for model in convergence_verdicts.DATA_OF for seed in convergence_verdicts.SEEDS]
    cells += [convergence_verdicts.cell(s, world_size, **options) for options in CONVERGENCE_PRECISIONS
              for s in CONVERGENCE_STRATEGIES if s == "single" or world_size > 1]
    if world_size > 1:
        cells += [convergence_verdicts.cell("ddp", world_size, precision="fp32", **options)
                  for options in CONVERGENCE_COMPRESSIONS]
    cells += [convergence_verdicts.cell(s, world_size, model=convergence_verdicts.VISION_MODEL, **options)
              for s, options in BATCH_NORM_CELLS if s == "single" or world_size > 1]
    return cells


def claims(world_size: int) -> list[CellSpec]:
    """The cells the published claims read (harness/claims/catalogue.py names them per claim): GPT-2
    tiny under each ZeRO stage in torch and DeepSpeed, checkpointing, bf16, the 8-bit and
    factored optimizers, and the compression hooks."""
    return claims_catalogue.cells(world_size)


SUITES: dict[str, Callable[[int], list[CellSpec]]] = {
    "smoke": smoke, "default": default, "full": full, "real": real, "perf": perf, "claims": claims,
    "convergence": convergence,
}
# Suites whose tests are benchmarks of the harness (suites/test_perf.py), not cells.
BENCHMARK_SUITES = frozenset({"perf"})
# Suites whose tests are claims (suites/claims/), one per claim; their cells run for them.
CLAIMS_SUITES = frozenset({"claims"})


def _distinct(cells: list[CellSpec]) -> list[CellSpec]:
    """The cells, each once; two different cells under one id (the id leaves out lr, steps and
    warmup) refused, since only one of them could be recorded."""
    by_id: dict[str, CellSpec] = {}
    for cell in cells:
        first = by_id.setdefault(cell.cell_id, cell)
        if first != cell:
            differ = [f"{name} {getattr(first, name)!r} and {getattr(cell, name)!r}"
                      for name in ("lr", "steps", "warmup") if getattr(first, name) != getattr(cell, name)]
            raise ValueError(f"two cells with the id {cell.cell_id} differ ({'; '.join(differ) or 'in an option'}):"
                             " a cell's id leaves lr, steps and warmup out, so a run holds one of them; put the"
                             " other values in a suite file of their own")
    return list(by_id.values())


def cells_of(suite: str, world_size: int, nnodes: int = 1, gpu: suites_gpu.GpuTarget | None = None,
             progress: Callable[[int], None] | None = None) -> list[CellSpec]:
    """The suite's cells, de-duplicated, each checked for compatibility up front. On GPUs
    (``gpu``: their memory) the default suite is the real-size matrix of harness/suites_gpu.py.
    ``progress(built)``: after each cell of a suite file (the built-in suites take a moment)."""
    if suite_files.is_suite_file(suite):
        return _distinct(suite_files.cells(Path(suite), world_size, nnodes, progress))
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}: choose one of {', '.join(SUITES)}, or a {suite_files.SUFFIX}"
                         " suite file")
    if suite in BENCHMARK_SUITES:
        return []
    on_gpus = suite == "default" and gpu is not None
    if world_size < 2 and not on_gpus:
        raise ValueError(f"--gpus {world_size}: the suites compare strategies across ranks; use 2 or more")
    made = suites_gpu.cells(world_size, gpu) if on_gpus and gpu is not None else SUITES[suite](world_size)
    cells = _distinct(made)
    for cell in cells:
        problem = strategies.incompatibility(cell)
        if problem:
            raise ValueError(f"suite {suite}: cell {cell.cell_id} is not a valid combination: {problem}")
    return cells
