"""The catalogue of published claims: ``CLAIMS`` (by claim id, in the order the suite runs
them and the report shows them), ``DEVIATIONS`` (why those that do not hold here do not) and
``cells`` (the cells the claims read: the claims suite)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from harness import convergence
from harness.claims import judges, published, zero_claims
from harness.claims.base import ACTIVATIONS_TOL, COMM_TOL, EXACT_TOL, MODEL_STATES_TOL, Claim, cell
from harness.config import CellSpec


def _cells(*specs: tuple[str, dict]) -> Callable[[int], list[CellSpec]]:
    return lambda world_size: [cell(s, world_size, **o) for s, o in specs]


def _tp_cells(world_size: int) -> list[CellSpec]:
    return [cell("tp", world_size)] if judges.tp_strategy_present() else []


def _sequence_parallel_cells(world_size: int) -> list[CellSpec]:
    plain = _tp_cells(world_size)
    return [*plain, cell("tp", world_size, sequence_parallel=True)] if plain else []


_ZERO = "Rajbhandari et al. 2020 (ZeRO)"
_KORTHIKANTI = "Korthikanti et al. 2022"
# ZeRO §5's model states per device at each stage, as published (K: optimizer bytes per parameter).
_STAGE_TEXT = {
    0: "baseline DP (2 + 2 + K)·Ψ",
    1: "P_os 2Ψ + 2Ψ + K·Ψ/N_d",
    2: "P_os+g 2Ψ + (2 + K)·Ψ/N_d",
    3: "P_os+g+p (2 + 2 + K)·Ψ/N_d",
}
_CLAIMS: list[Claim] = []

for _s, (_title, _formula) in zero_claims.MODEL_STATES.items():
    _CLAIMS.append(Claim(
        claim_id=f"model_states/{_s}", title=_title, source=f"{_ZERO} §5, Table 1",
        published=(_STAGE_TEXT[zero_claims.stage_held_at_step(_s)]
                   + " (mixed precision: 2-byte params and grads, K = 12)"),
        formula=_formula + "; analytic.model_states_at_step, per rank",
        tolerance=f"±{MODEL_STATES_TOL:.0%}, least rank (a rank can still hold a communication buffer in flight)",
        unit="bytes", judge=judges.model_states(_s), cells=_cells((_s, {}))))

_CLAIMS.append(Claim(
    claim_id="comm_volume/ddp", title="DDP all-reduces the gradients: 2Ψ per step",
    source=f"{_ZERO} §7", published="data parallelism moves 2Ψ per step (reduce-scatter + all-gather)",
    formula="2 × 4Ψ bytes (fp32 gradients; an all-reduce counts twice)",
    tolerance=f"±{COMM_TOL:.0%}", unit="bytes", judge=judges.ddp_comm_volume, cells=_cells(("ddp", {}))))
for _s, _title in zero_claims.COMM_VOLUME.items():
    _CLAIMS.append(Claim(
        claim_id=f"comm_volume/{_s}", title=_title,
        source=f"{_ZERO} §7" + ("; Zhao et al. 2023 (FSDP) §3.2.1" if _s.startswith("fsdp") else ""),
        published="ZeRO-1/2 2Ψ = 1× DDP" if zero_claims.zero_stage(_s) < 3 else "ZeRO-3 3Ψ = 1.5× DDP",
        formula="volume(cell) / volume(DDP), volume = Σ bytes per op, all-reduce ×2 (analytic.comm_volume)",
        tolerance=f"±{COMM_TOL:.0%} (exact byte counts; padding and scalar flags only)", unit="× DDP",
        judge=judges.comm_volume(_s), cells=_cells((_s, {}), ("ddp", {}))))

_CLAIMS += [
    Claim(claim_id="activations/none", title="Activation bytes without recompute",
          source=f"{_KORTHIKANTI} §4.1-4.2, Table 2",
          published="s·b·h·(34 + 5·a·s/h) per layer (16-bit, dropout)",
          formula="L · [v·(8sbh + 2sbf) + 4asb] + 4sbV: v = 4 B (fp32), f = 4h, no dropout, SDPA keeps no"
                  " s×s scores (analytic.activation_bytes_per_layer), + the fp32 logits",
          tolerance=f"±{ACTIVATIONS_TOL:.0%}", unit="bytes", judge=judges.activations_none, cells=_cells(("ddp", {}))),
    Claim(claim_id="activations/full", title="Full recompute keeps only each layer's input",
          source=f"{_KORTHIKANTI} §4.3; Chen et al. 2016",
          published="2·s·b·h per layer (16-bit), one layer's activations recomputed at a time",
          formula="L·4sbh (fp32 layer inputs) + one layer recomputed during its backward (Table 2 row);"
                  " the loss and head have run their backward by then",
          tolerance=f"±{ACTIVATIONS_TOL:.0%}", unit="bytes", judge=judges.activations_full,
          cells=_cells(("ddp", {"checkpointing": "full"}), ("ddp", {}))),
    Claim(claim_id="activations/checkpoint_every_linear",
          title="Checkpointing some blocks: activations fall linearly with the blocks checkpointed",
          source=f"{_KORTHIKANTI} §4 (per-layer activations add up); torch checkpoint_wrapper per block",
          published="each checkpointed block keeps its input alone, the others all they saved",
          formula="none − (checkpointed ÷ blocks)·(none − every block), as the head's forward holds them",
          tolerance=f"±{ACTIVATIONS_TOL:.0%}", unit="bytes", judge=judges.activations_checkpoint_every,
          cells=_cells(("ddp", {"checkpointing": "full", "checkpoint_every": 2}), ("ddp", {"checkpointing": "full"}),
                       ("ddp", {}))),
    Claim(claim_id="activations/selective", title="Selective recompute: the harness's policy against the paper's",
          source=f"{_KORTHIKANTI} §4.3", published="s·b·h·34 per layer: the attention core (5as²b) recomputed",
          formula="Table 2 selective row with SDPA: the a·s² terms are already absent",
          tolerance="n/a (different policies)", unit="bytes", judge=judges.activations_selective,
          cells=_cells(("ddp", {"checkpointing": "selective"}), ("ddp", {}))),
    Claim(claim_id="activations/selective_70pct", title="Selective recompute saves 70% of activations on GPT-3 175B",
          source=f"{_KORTHIKANTI} §4.3, Table 2", published="70% less activation memory (TP 8 + SP)",
          formula="1 − 34/t ÷ (34/t + 5as/(ht)), s = 2048, h = 12288, a = 96, t = 8",
          tolerance="±0.5 percentage point (the paper rounds to whole %)", unit="fraction saved",
          judge=judges.selective_recompute_70pct),
    Claim(claim_id="activations/bf16_half", title="16-bit activations take half of fp32's",
          source=f"{_KORTHIKANTI} §4 (2-byte activations); Micikevicius et al. 2018",
          published="½ of fp32's activation bytes",
          formula="(L·per-layer(2 B) + fp32 logits) ÷ (L·per-layer(4 B) + fp32 logits)",
          tolerance=f"±{ACTIVATIONS_TOL:.0%}", unit="bf16 / fp32", judge=judges.activations_bf16_half,
          cells=_cells(("ddp", {"precision": "bf16"}), ("ddp", {}))),
    Claim(claim_id="activations/eager_scores", title="Eager attention keeps the s×s scores; fused attention does not",
          source=f"{_KORTHIKANTI} §4.1 (the 5as²b term); Dao et al. 2022 (FlashAttention)",
          published="the a·s² terms of s·b·h·(34 + 5·a·s/h) are the score matrix; fused kernels never store it",
          formula="L·(v·a·s²·b − 4·a·s·b): the fp32 softmax output eager keeps, less the fp32 log-sum-exp per row"
                  " SDPA keeps (no dropout: no mask, no dropout output); analytic.activation_bytes eager − sdpa",
          tolerance=f"±{EXACT_TOL:.0%}", unit="bytes", judge=judges.eager_attention_scores,
          cells=_cells(("ddp", {"attention": "eager"}), ("ddp", {}))),
    Claim(claim_id="pipeline/bubble", title="The pipeline bubble is (p−1)/(m+p−1) of a step",
          source="Huang et al. 2019 (GPipe); Narayanan et al. 2021 §2.2",
          published="bubble ÷ ideal time (p−1)/m for GPipe and 1F1B, divided by v when interleaved",
          formula="analytic.pipeline_bubble_fraction(p, m) = (p−1)/(m+p−1); interleaved (p−1)/(v·m+p−1)",
          tolerance="n/a (not measured)", unit="fraction of the step", judge=judges.pipeline_bubble),
    Claim(claim_id="tensor_parallel/params_split", title="Tensor parallelism divides the split layers' parameters by t",
          source="Shoeybi et al. 2019 (Megatron-LM) §3",
          published="column- and row-parallel linear layers hold 1/t of their weights per rank; the rest is replicated",
          formula="4·(sharded/t + replicated) bytes of fp32 parameters per rank (analytic.tp_model_states,"
                  " analytic.tp_sharded_numel)",
          tolerance=f"±{EXACT_TOL:.0%}", unit="bytes", judge=judges.tp_params_split, cells=_tp_cells),
    Claim(claim_id="tensor_parallel/sequence_parallel_volume",
          title="Sequence parallelism moves a block's activations at tensor parallelism's volume",
          source=f"{_KORTHIKANTI} §4.2.2",
          published="a block's all-reduce becomes a reduce-scatter and an all-gather: the same bandwidth",
          formula="analytic comm volume with sequence_parallel ÷ without: 1, but for the gathers outside the blocks"
                  " and the norms' gradients (analytic_parallel._tp_activation_collectives)",
          tolerance=f"±{EXACT_TOL:.0%}", unit="volume with ÷ without", judge=judges.sequence_parallel_volume,
          cells=_sequence_parallel_cells),
    Claim(claim_id="optimizer/adamw8bit_quarter", title="8-bit AdamW state is a quarter of AdamW's 32-bit moments",
          source="Dettmers et al. 2022", published="2 B/param against 8 B/param: 75% less",
          formula="analytic.optimizer_state_bytes: uint8 moments + fp32 absmax per 256 values; tensors < 4,096"
                  " values keep fp32 state",
          tolerance=f"±{EXACT_TOL:.0%} of the formula's ratio; the formula within 5% of ¼ at GPT-2 124M",
          unit="8-bit / 32-bit", judge=judges.adamw8bit_quarter,
          cells=_cells(("ddp", {"optimizer": "adamw8bit"}), ("ddp", {}))),
    Claim(claim_id="optimizer/adafactor_factored", title="Adafactor keeps a factored second moment, no first moment",
          source="Shazeer & Stern 2018", published="O(n + m) state for an n×m matrix",
          formula="analytic.optimizer_state_bytes: 4·(n + m) per matrix, 4·n per vector, + step",
          tolerance=f"±{EXACT_TOL:.0%}", unit="bytes", judge=judges.adafactor_factored,
          cells=_cells(("ddp", {"optimizer": "adafactor"}), ("ddp", {}))),
    *(Claim(claim_id=f"compression/powersgd_r{rank}",
            title=f"PowerSGD rank {rank} all-reduces (m + n)·r per m×n gradient",
            source="Vogels et al. 2019; torch powerSGD_hook",
            published="m·n → (m + n)·r elements per compressed gradient",
            formula="4 · Σ analytic.powersgd_elements(shape, r) bytes (uncompressed when not worth it)",
            tolerance=f"±{EXACT_TOL:.0%}", unit="bytes", judge=judges.powersgd(rank),
            cells=_cells(("ddp", {"compression": "powersgd", "powersgd_rank": rank}), ("ddp", {})))
      for rank in (1, 4)),
    *(Claim(claim_id=f"compression/{name}", title=title, source=source, published=published, formula=formula,
            tolerance=f"±{EXACT_TOL:.0%}", unit="bytes", judge=judges.compressed_bytes(name),
            cells=_cells(("ddp", {"compression": name}), ("ddp", {})))
      for name, title, source, published, formula in (
          ("int8_tensor", "torch's per-tensor int8 hook all-gathers one byte per gradient",
           "torch ddp_comm_hooks.quantization_hooks", "4 B → 1 B per gradient, plus a scale and zero point",
           "formulas.int8_allgather_bytes: n·(8 + Ψ) as gathered"),
          ("int8_channel", "torch's per-channel int8 hook all-gathers one byte per gradient, 512 to a channel",
           "torch ddp_comm_hooks.quantization_hooks", "4 B → 1 B per gradient, plus a scale and zero point a channel",
           "formulas.int8_allgather_bytes: n·C·(8 + 512), C = Ψ // 512 + 1"),
          ("topk", "top-k sends 1 % of the gradients, with their indices",
           "Aji & Heafield 2017; Lin et al. 2018 (DGC)", "k values and k indices per rank",
           "formulas.sparsified_bytes: 8·n·k as gathered, k = ⌈0.01 Ψ⌉"),
          ("randomk", "random-k all-reduces 1 % of the gradients, the same entries on every rank",
           "Stich, Cordonnier & Jaggi 2018", "k values; the indices come from a shared seed",
           "formulas.sparsified_bytes: 4·k, k = ⌈0.01 Ψ⌉"))),
    Claim(claim_id="compression/fp16_hook_half", title="fp16_compress_hook halves the all-reduce bytes",
          source="torch ddp_comm_hooks.default_hooks", published="½ of DDP's all-reduce bytes",
          formula="2Ψ bytes against 4Ψ", tolerance=f"±{EXACT_TOL:.0%}", unit="fp16 / fp32",
          judge=judges.fp16_hook_half, cells=_cells(("ddp", {"compression": "fp16"}), ("ddp", {}))),
    *(Claim(claim_id=f"precision/{fmt}_range", title=f"{fmt} range and precision",
            source="IEEE 754 / Google Brain bfloat16; formulas.md \"Precision\"",
            published=", ".join(f"{k} {v:.3g}" for k, v in published.PRECISION_TABLE[fmt].items()),
            formula="torch.finfo (max, smallest_normal, eps); nextafter(0, 1) for the smallest subnormal",
            tolerance="±0.5% (the table prints 3 significant digits)", unit="value", judge=judges.precision_range(fmt))
      for fmt in ("fp16", "bf16")),
    Claim(claim_id="precision/fp16_loss_scaling", title="fp16 needs loss scaling; bf16 does not",
          source="Micikevicius et al. 2018 §3.2",
          published="gradients below 2^-24 flush to zero in fp16 unless the loss is scaled",
          formula="upstream gradient 2^-30 through an autocast matmul; GradScaler(init_scale=2^24) then unscale",
          tolerance="no fp16 gradient survives unscaled, every one scaled, error ≤ 1%",
          unit="Σ|scaled| / Σ|fp32|", judge=judges.fp16_loss_scaling),
    Claim(claim_id="precision/fp16_gradient_underflow",
          title="Loss scaling keeps a real model's fp16 gradients out of the subnormals",
          source="Micikevicius et al. 2018 §3.2, Figure 3",
          published="a share of the gradients lies below fp16's normal range and flushes to zero or subnormals"
                    " unless the loss is scaled, which shifts them into it",
          formula="the DDP fp16 cell's gradients on its last warm-up step (record numerics.gradient_range): the"
                  " fraction zero or subnormal in fp16 as held (× GradScaler's 2^16) and divided by the scale",
          tolerance=f"scaled: at most {judges.UNDERFLOW_TOL:.0%} beyond the gradients zero in fp32 already;"
                    " unscaled: more than scaled",
          unit="fraction of gradient values", judge=judges.fp16_gradient_underflow,
          cells=_cells(("ddp", {"precision": "fp16"}))),
    Claim(claim_id="precision/autocast_fp32_ops", title="Autocast keeps LayerNorm and softmax in fp32",
          source="torch.amp autocast op reference (ops that autocast to float32); Micikevicius et al. 2018 §3.3",
          published="reductions and normalisations (layer_norm, softmax, log_softmax) run in fp32 under autocast;"
                    " matmuls in the low precision",
          formula="the output dtype of every aten op of a GPT-2 forward and loss (eager attention) under"
                  " autocast bf16 and fp16, on this host's device",
          tolerance="every layer_norm, softmax and log_softmax float32; every mm, addmm, bmm the low precision",
          unit="dtype", judge=judges.autocast_fp32_ops),
    Claim(claim_id="precision/bf16_converges", title="bf16 trains to fp32's held-out loss on real text",
          source="Kalamkar et al. 2019 (bf16 for deep learning training); Micikevicius et al. 2018",
          published="bf16 mixed precision reaches the fp32 run's accuracy without loss scaling or tuned"
                    " hyper-parameters",
          formula="harness/convergence.py: the final held-out loss after 200 steps on the standard library's bytes,"
                  " bf16 against fp32 (one process)",
          tolerance="within the spread of three fp32 seeds' final held-out losses", unit="held-out loss",
          judge=judges.bf16_converges,
          cells=lambda world_size: [convergence.cell("single", world_size, seed=seed, precision=p)
                                    for p, seeds in (("fp32", convergence.SEEDS), ("bf16", (0,))) for seed in seeds]),
    Claim(claim_id="zero/table1", title="ZeRO Table 1 recomputed from the model-state formulas",
          source=f"{_ZERO} Table 1", published="54 entries, GB per device, K = 12",
          formula="analytic.zero_model_states(Ψ, N_d, stage).total / 1e9",
          tolerance="one unit in the last printed digit", unit="entries", judge=judges.zero_table_1),
]

# Claims that do not hold here, and why (checked against the records and the engines' code):
# their "does not hold" is an expected failure, and their test fails once they hold again, so
# an explanation cannot go stale (suites/claims/conftest.py).
for _quantity, _what in (("step_time", "step time (harness/predict/step_time.py, at the run's measured rates)"),
                         ("peak", "peak per rank (the analytic whole peak, harness/predict/analytic.py)")):
    _CLAIMS.append(Claim(
        claim_id=f"order/{_quantity}", title=f"The predicted {_quantity.replace('_', ' ')} orders the strategies as"
                                             " the measurement does",
        source="shardbench's predictors (issue 16); Kendall 1945 for τ_b",
        published=f"the data-parallel and ZeRO strategies ranked by predicted {_what} in the measured order",
        formula="Kendall's τ_b between predicted and measured values over "
                + ", ".join(zero_claims.MODEL_STATES),
        tolerance=f"τ_b ≥ {judges.ORDER_TAU} (at least 75 % of the pairs ordered alike)", unit="τ_b",
        judge=judges.strategy_order(_quantity), cells=_cells(*((s, {}) for s in zero_claims.MODEL_STATES))))

_CLAIMS.append(Claim(
    claim_id="activations/linear_time",
    title="A state-space model's activations grow linearly with the sequence; eager attention's quadratically",
    source=f"Gu & Dao 2023 (Mamba) §3.3; {_KORTHIKANTI} §4.1 (the 5as²b term)",
    published="Mamba: memory linear in sequence length; a transformer layer keeps 34·s·b·h + 5·a·s²·b",
    formula=(f"Mamba's activation bytes per token at {judges.LINEAR_TIME_LENGTHS[-1]} tokens ÷ at"
             f" {judges.LINEAR_TIME_LENGTHS[0]} (1 when linear, ±{judges.LINEAR_TIME_TOL:.0%}); GPT-2 (eager)"
             f" against analytic.activation_bytes at each of {', '.join(map(str, judges.LINEAR_TIME_LENGTHS))}"
             f" tokens (±{ACTIVATIONS_TOL:.0%}); one process, suites/configs/mamba-tiny.json, gpt2-long-tiny.json"),
    tolerance=f"±{judges.LINEAR_TIME_TOL:.0%}", unit="per-token ratio", judge=judges.activations_linear_time,
    cells=lambda world_size: judges.linear_time_cells()))

_CLAIMS.append(Claim(
    claim_id="moe/aux_loss_balances", title="The router's load-balancing loss spreads the tokens more evenly",
    source="Fedus et al. 2022 (Switch Transformer) §2.2; Shazeer et al. 2017 (importance loss)",
    published="an auxiliary loss α·N·Σ f_i·P_i pushes the router toward a uniform load",
    formula=("mean imbalance (most loaded expert ÷ mean, measure/expert_load.py) over the second half of"
             f" {judges.MOE_STEPS} steps, with α = {judges.MOE_AUX_COEF} ÷ without; moe-tiny, one process"),
    tolerance="< 1 (lower with the loss)", unit="× without", judge=judges.moe_aux_loss_balances,
    cells=lambda world_size: judges.moe_balance_cells()))

DEVIATIONS = {
    "comm_volume/zero1": (
        "ZeroRedundancyOptimizer runs over DDP: the gradients are all-reduced in full (2Ψ), then each"
        " owner broadcasts its updated parameters (Ψ): 3Ψ, not the paper's reduce-scatter + all-gather"),
    "comm_volume/deepspeed_zero1": (
        "DeepSpeed reduces the gradient bucket with an all-reduce (2Ψ) before all-gathering the updated"
        " partitions (Ψ): 3Ψ, not the paper's reduce-scatter + all-gather (2Ψ)"),
    "comm_volume/deepspeed_zero2": (
        "as ZeRO-1: the gradient bucket is all-reduced (2Ψ), then the updated partitions all-gathered (Ψ)"),
    "comm_volume/deepspeed_zero3": (
        "DeepSpeed keeps gathered parameters for backward while they fit stage3_max_live_parameters and"
        " stage3_max_reuse_distance (1e9 each by default, far above this model): one all-gather per step, not"
        " two (analytic.comm_bytes_per_step predicts this)"),
    "activations/none": (
        "the formula counts a fused GeLU (its input and output); GPT-2's gelu_new is composed of element-wise"
        " ops that keep three more s·b·4h tensors per layer (tanh, 0.5·x, 1 + tanh), and the final"
        " LayerNorm's input and output are outside the per-layer formula; the harness's value is at the"
        " step's peak, early in backward"),
    "activations/full": (
        "the layer being recomputed keeps what GPT-2's unfused gelu_new keeps: three s·b·4h tensors more than"
        " the fused GeLU the formula counts (tanh, 0.5·x, 1 + tanh); at the peak part of that layer is"
        " already freed"),
    "activations/bf16_half": (
        "CPU autocast runs only the matmul-class ops in bf16: the residual stream (the LayerNorm inputs) and"
        " the loss's log-softmax stay fp32, and the bf16 copies of the weights that autocast makes for the"
        " forward are saved for backward, so they count as activations"),
}

CLAIMS: dict[str, Claim] = {c.claim_id: dataclasses.replace(c, deviation=DEVIATIONS.get(c.claim_id))
                            for c in _CLAIMS}
assert set(DEVIATIONS) <= set(CLAIMS), set(DEVIATIONS) - set(CLAIMS)


def cells(world_size: int, claim_ids: list[str] | None = None) -> list[CellSpec]:
    """The cells the claims read (all of them, or those of ``claim_ids``), each once, in order."""
    out: dict[str, CellSpec] = {}
    for claim_id in claim_ids if claim_ids is not None else CLAIMS:
        for c in CLAIMS[claim_id].cells(world_size):
            out.setdefault(c.cell_id, c)
    return list(out.values())

