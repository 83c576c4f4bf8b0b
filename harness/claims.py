"""Published claims, re-derived from the papers' formulas (harness/predict/analytic.py) and,
where this host can run the cells, measured (suites/claims/, ``--suite claims``).

Each claim reads the cells it names (``Claim.cells``: the claims suite is the union of them)
and gives one claim record, appended to ``results/<run_id>/claims.jsonl`` the way cells.jsonl
is (one line, flushed and fsynced), which the run's HTML report renders:

    {claim_id, title, source, published, formula, unit, predicted, measured, ratio,
     tolerance, verdict, reason, explained, cell_failed, world_size, cells, details}

``verdict`` is "holds", "does not hold" or "not measurable here" (a cell this host cannot
run, or a measurement that is not the quantity the formula describes; ``reason`` says which).
``ratio`` is measured / predicted. Where a claim does not hold for a reason understood and
written down (``Claim.deviation``), the reason is that explanation and the claims test
reports it as an expected failure; if such a claim starts to hold, its test fails until the
explanation is removed.

Conventions: memory in bytes per rank, communication in bytes per rank per step in the
harness's counting convention (harness/measure/comm.py) and, for volumes, ZeRO §7's (an
all-reduce counts twice), from the cells' records (README "Results format").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness import suites
from harness.config import CellSpec

VERDICTS = ("holds", "does not hold", "not measurable here")
CLAIMS_FILE = "claims.jsonl"

MODEL = "gpt2-tiny"

# No timing is read: the fewest steps every claims cell accepts (PowerSGD's 3 warm-up steps,
# the memory and the comm probe, 2 timed); one count for all, as the cells share references.
STEPS = 7

# Tolerances, decided from what the quantities are (README "Claims" gives the reasons):
MODEL_STATES_TOL = 0.10  # the brief's; tensor bytes are exact, engines add alignment padding
COMM_TOL = 0.02  # byte counts are exact; only padding and scalar flags (4-8 B) separate them
ACTIVATIONS_TOL = 0.20  # the formula leaves out small terms (embeddings, final norm, loss)
EXACT_TOL = 0.01  # formula and measurement count the same tensors


def cell(strategy: str, world_size: int, attention: str = "sdpa", **options) -> CellSpec:
    """A claims cell: GPT-2 tiny, fp32 AdamW, SDPA attention unless the options vary it."""
    return dataclasses.replace(suites._cell(MODEL, strategy, world_size, **options), steps=STEPS, attention=attention)


class NotMeasurable(Exception):
    """A claim cannot be measured: ``failed`` when a cell crashed or left no numbers (the
    test fails), not when the host cannot run it (the test is skipped)."""

    def __init__(self, reason: str, *, failed: bool = False):
        super().__init__(reason)
        self.failed = failed


@dataclass(frozen=True, kw_only=True)
class Outcome:
    predicted: float | None
    measured: float | str | None
    verdict: str
    reason: str = ""
    details: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if isinstance(self.measured, (int, float)) and self.predicted:
            return self.measured / self.predicted
        return None


class Readings:
    """The claim's view of a run: its cells' records, refused unless measured. A run with
    --repeat gives each cell's trials folded (harness/results/trials.py: median metrics, the
    per-rank numbers of the trial nearest the median, ok only when every trial was)."""

    def __init__(self, record_of: Callable[[CellSpec], dict | None], world_size: int):
        self._record_of = record_of
        self.world_size = world_size

    def cell(self, strategy: str, attention: str = "sdpa", **options) -> CellSpec:
        return cell(strategy, self.world_size, attention, **options)

    def record(self, c: CellSpec) -> dict:
        record = self._record_of(c)
        if record is None:
            raise NotMeasurable(f"{c.cell_id}: no record (the cell was not run)", failed=True)
        if record["status"] != "ok":
            first = (record.get("reason") or "").strip().splitlines()
            raise NotMeasurable(f"{c.cell_id}: {record['status']}" + (f": {first[0]}" if first else ""),
                                failed=record["status"] not in ("unsupported", "oom"))
        return record


@dataclass(frozen=True, kw_only=True)
class Claim:
    claim_id: str
    title: str
    source: str
    published: str
    formula: str
    tolerance: str
    unit: str
    judge: Callable[[Readings], Outcome]
    cells: Callable[[int], list[CellSpec]] = lambda world_size: []
    # Why the claim does not hold here, when that is understood (see the module docstring).
    deviation: str | None = None


def _compare(measured: float, predicted: float, tol: float, *, details: dict | None = None,
             note: str = "") -> Outcome:
    ok = abs(measured / predicted - 1) <= tol
    reason = note if ok else (f"measured / predicted = {measured / predicted:.3f}, outside ±{tol:.0%}"
                              + (f"; {note}" if note else ""))
    return Outcome(predicted=predicted, measured=measured, verdict="holds" if ok else "does not hold",
                   reason=reason, details=details or {})


def _layout(c: CellSpec):
    from harness import models

    return models.param_layout(models.get_preset(c.model))


# --- model states per rank (ZeRO §3.1, §5, Table 1) -------------------------------------------

_STAGE_TEXT = {
    0: "baseline DP (2 + 2 + K)·Ψ",
    1: "P_os 2Ψ + 2Ψ + K·Ψ/N_d",
    2: "P_os+g 2Ψ + (2 + K)·Ψ/N_d",
    3: "P_os+g+p (2 + 2 + K)·Ψ/N_d",
}
# strategy -> (ZeRO stage it holds at the optimizer step, title, formula with its bytes)
_MODEL_STATES = {
    "ddp": (0, "DDP holds every model state on every rank",
            "4Ψ params + 4Ψ grads + 8Ψ AdamW moments + 4Ψ DDP gradient bucket (fp32: no master copy)"),
    "zero1": (1, "torch ZeroRedundancyOptimizer (ZeRO-1) shards the optimizer state",
              "4Ψ + 4Ψ + 8Ψ/N_d + 4Ψ DDP bucket"),
    "fsdp_grad_op": (3, "FSDP2 SHARD_GRAD_OP (the ZeRO-2 idea) holds ZeRO-3's layout at the optimizer"
                        " step: it reshards parameters after backward",
                     "(4 + 4 + 8)·Ψ/N_d"),
    "fsdp_full": (3, "FSDP2 FULL_SHARD (ZeRO-3) shards parameters, gradients and optimizer state",
                  "(4 + 4 + 8)·Ψ/N_d"),
    "deepspeed_zero1": (1, "DeepSpeed ZeRO-1 shards the optimizer state (and, as DeepSpeed does, the"
                           " reduced gradients)",
                        "4Ψ params + 4Ψ/N_d grads + (4 + 8)·Ψ/N_d fp32 master + moments"),
    "deepspeed_zero2": (2, "DeepSpeed ZeRO-2 shards optimizer state and gradients",
                        "4Ψ params + 4Ψ/N_d grads + (4 + 8)·Ψ/N_d fp32 master + moments"),
    "deepspeed_zero3": (3, "DeepSpeed ZeRO-3 shards parameters, gradients and optimizer state",
                        "(4 + 4 + 4 + 8)·Ψ/N_d: params, grads, fp32 master, moments; + the reduce bucket"
                        " it keeps between steps, min(Ψ, 5e8)·4"),
}


def _model_states_claim(strategy: str) -> Callable[[Readings], Outcome]:
    def judge(r: Readings) -> Outcome:
        from harness.predict import analytic_data_parallel, formulas

        c = r.cell(strategy)
        record = r.record(c)
        held = [p["at_optimizer_step_bytes"] for p in record["per_rank"] if p.get("at_optimizer_step_bytes")]
        if not held:
            raise NotMeasurable(f"{c.cell_id}: no at_optimizer_step_bytes in the record", failed=True)
        totals = [sum(h.values()) for h in held]
        least = min(range(len(held)), key=lambda i: totals[i])
        layout = _layout(c)
        by_state = analytic_data_parallel.model_states_at_step(c, layout)
        stage = _MODEL_STATES[strategy][0]
        paper = formulas.zero_model_states(layout.numel, c.world_size, stage, **formulas.FP32_ADAM).total
        return _compare(totals[least], sum(by_state.values()), MODEL_STATES_TOL, details={
            "per_rank_total_bytes": totals,
            "breakdown_bytes": held[least],
            "predicted_bytes": by_state,
            "paper_formula_fp32_bytes": paper,
            "n_params": layout.numel,
            "world_size": c.world_size,
        })

    return judge


# --- communication volume (ZeRO §7, FSDP §3.2.1) ------------------------------------------------

_COMM = {
    # strategy -> (ZeRO stage, title)
    "zero1": (1, "torch ZeRO-1 (ZeroRedundancyOptimizer over DDP) moves what DDP moves"),
    "fsdp_grad_op": (2, "FSDP2 SHARD_GRAD_OP (ZeRO-2) moves what DDP moves"),
    "deepspeed_zero1": (1, "DeepSpeed ZeRO-1 moves what DDP moves"),
    "deepspeed_zero2": (2, "DeepSpeed ZeRO-2 moves what DDP moves"),
    "fsdp_full": (3, "FSDP2 FULL_SHARD (ZeRO-3) moves 1.5× DDP's bytes"),
    "deepspeed_zero3": (3, "DeepSpeed ZeRO-3 moves 1.5× DDP's bytes"),
}


def _bytes_by_op(record: dict) -> dict[str, float]:
    return {op: stats["bytes"] for op, stats in (record["metrics"].get("comm_by_op") or {}).items()}


def _comm_claim(strategy: str) -> Callable[[Readings], Outcome]:
    def judge(r: Readings) -> Outcome:
        from harness.predict import analytic_data_parallel, formulas

        c, ddp = r.cell(strategy), r.cell("ddp")
        mine, base = _bytes_by_op(r.record(c)), _bytes_by_op(r.record(ddp))
        layout = _layout(c)
        stage = _COMM[strategy][0]
        published = formulas.zero_comm_elements(layout.numel, stage) / formulas.zero_comm_elements(layout.numel, 0)
        engine = (formulas.comm_volume(analytic_data_parallel.comm_bytes_per_step(c, layout))
                  / formulas.comm_volume(analytic_data_parallel.comm_bytes_per_step(ddp, layout)))
        measured = formulas.comm_volume(mine) / formulas.comm_volume(base)
        return _compare(measured, published, COMM_TOL, details={
            "bytes_by_op": mine, "ddp_bytes_by_op": base,
            "volume_bytes": formulas.comm_volume(mine), "ddp_volume_bytes": formulas.comm_volume(base),
            "engine_predicted_ratio": engine,
        })

    return judge


def _ddp_comm(r: Readings) -> Outcome:
    c = r.cell("ddp")
    by_op = _bytes_by_op(r.record(c))
    from harness.predict import formulas

    psi = _layout(c).numel
    return _compare(formulas.comm_volume(by_op), 4 * formulas.zero_comm_elements(psi, 0), COMM_TOL,
                    details={"bytes_by_op": by_op, "n_params": psi})


# --- activations (Korthikanti et al. 2022, §4, Table 2) -----------------------------------------

def _per_layer(c: CellSpec, checkpointing: str | None = None, value_bytes: int | None = None) -> float:
    """Korthikanti's per-layer bytes for this cell's model as the harness runs it: no dropout,
    SDPA (fused) attention, GPT-2's GeLU MLP, fp32 values unless told."""
    from harness import models
    from harness.predict import formulas

    spec = models.get_preset(c.model)
    return formulas.activation_bytes_per_layer(
        spec.tokens_per_sample, c.micro_batch, spec.hidden, spec.n_heads, ffn=spec.ffn, mlp="gelu",
        value_bytes=value_bytes or (4 if c.strategy.precision == "fp32" else 2), dropout=False,
        fused_attention=True, checkpointing=checkpointing or c.strategy.checkpointing)


def _logits_bytes(c: CellSpec) -> float:
    from harness import models

    spec = models.get_preset(c.model)
    return 4.0 * spec.tokens_per_sample * c.micro_batch * spec.vocab_size  # fp32, HF upcasts


def _activations_at_peak(r: Readings, c: CellSpec) -> float:
    return r.record(c)["metrics"]["mem_breakdown_bytes"]["activations"]


def _layers(c: CellSpec) -> int:
    from harness import models

    return models.get_preset(c.model).n_layers


def _activations_none(r: Readings) -> Outcome:
    c = r.cell("ddp")
    per_layer = _per_layer(c)
    predicted = _layers(c) * per_layer + _logits_bytes(c)
    return _compare(_activations_at_peak(r, c), predicted, ACTIVATIONS_TOL,
                    details={"per_layer_bytes": per_layer, "layers": _layers(c), "logits_bytes": _logits_bytes(c)})


def _activations_full(r: Readings) -> Outcome:
    c = r.cell("ddp", checkpointing="full")
    kept, recomputed = _per_layer(c), _per_layer(c, "none")
    # The peak falls in a layer's recompute, after the loss and the head ran their backward
    # (their activations, the logits among them, are freed by then).
    predicted = _layers(c) * kept + recomputed
    return _compare(_activations_at_peak(r, c), predicted, ACTIVATIONS_TOL, details={
        "kept_per_layer_bytes": kept, "recomputed_layer_bytes": recomputed,
        "no_checkpointing_bytes": _activations_at_peak(r, r.cell("ddp"))})


def _activations_selective(r: Readings) -> Outcome:
    c = r.cell("ddp", checkpointing="selective")
    measured = _activations_at_peak(r, c)
    none = _activations_at_peak(r, r.cell("ddp"))
    predicted = _layers(c) * _per_layer(c) + _logits_bytes(c)
    return Outcome(
        predicted=predicted, measured=measured, verdict="not measurable here",
        reason=("the harness's selective policy is not Korthikanti's: it saves matmul and SDPA outputs and"
                " recomputes the element-wise ops, while the paper recomputes the attention core (the"
                " a·s² terms), which SDPA never stores, so the paper's selective recompute saves nothing"
                f" on this model; the harness's policy kept {measured / none:.2f}× the activations of no"
                " checkpointing"),
        details={"no_checkpointing_bytes": none, "saved_fraction": 1 - measured / none})


def _activations_bf16(r: Readings) -> Outcome:
    fp32, bf16 = r.cell("ddp"), r.cell("ddp", precision="bf16")
    measured = _activations_at_peak(r, bf16) / _activations_at_peak(r, fp32)
    layers = _layers(fp32)
    predicted = ((layers * _per_layer(bf16) + _logits_bytes(bf16))
                 / (layers * _per_layer(fp32) + _logits_bytes(fp32)))
    return _compare(measured, predicted, ACTIVATIONS_TOL, details={
        "bf16_bytes": _activations_at_peak(r, bf16), "fp32_bytes": _activations_at_peak(r, fp32)})


def _selective_70(r: Readings) -> Outcome:
    from harness.predict import formulas

    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B's layer, 8-way tensor and sequence parallel
    none = formulas.activation_bytes_per_layer(s, b, h, a, tensor_parallel=t, sequence_parallel=True)
    selective = formulas.activation_bytes_per_layer(s, b, h, a, tensor_parallel=t, sequence_parallel=True,
                                                    checkpointing="selective")
    saved = 1 - selective / none
    ok = abs(saved - 0.70) <= 0.005
    return Outcome(predicted=0.70, measured=saved, verdict="holds" if ok else "does not hold",
                   reason="" if ok else f"the formula saves {saved:.1%}",
                   details={"no_recompute_bytes_per_layer": none, "selective_bytes_per_layer": selective})


def _eager_scores(r: Readings) -> Outcome:
    from harness import models
    from harness.predict.analytic_data_parallel import activation_bytes

    eager, sdpa = r.cell("ddp", attention="eager"), r.cell("ddp")
    spec = models.get_preset(eager.model)
    predicted = (activation_bytes(eager, spec)["layers"] - activation_bytes(sdpa, spec)["layers"])
    measured = _activations_at_peak(r, eager) - _activations_at_peak(r, sdpa)
    s, b, a = spec.tokens_per_sample, eager.micro_batch, spec.n_heads
    return _compare(measured, predicted, EXACT_TOL, details={
        "eager_bytes": _activations_at_peak(r, eager), "sdpa_bytes": _activations_at_peak(r, sdpa),
        "scores_per_layer_bytes": 4 * a * s * s * b, "logsumexp_per_layer_bytes": 4 * a * s * b,
        "layers": spec.n_layers})


# --- pipeline bubble (no cells) -------------------------------------------------------------------

def _pipeline_bubble(r: Readings) -> Outcome:
    from harness.config import DEFAULT_PP_MICROBATCHES
    from harness.predict import formulas

    p, m = r.world_size, DEFAULT_PP_MICROBATCHES
    return Outcome(
        predicted=formulas.pipeline_bubble_fraction(p, m), measured=None, verdict="not measurable here",
        reason=("a bubble is idle time, read from step times: on this shared 2-core CPU host the stages compete"
                " for the same cores and gloo's point-to-point waits are scheduler noise, so no step time separates"
                f" the bubble; the formula's value for p = {p}, m = {m} is shown"),
        details={"stages": p, "microbatches": m,
                 "bubble_over_ideal": (p - 1) / m,
                 "interleaved_v2": formulas.pipeline_bubble_fraction(p, m, virtual_stages=2),
                 "gpipe_4p_microbatches": formulas.pipeline_bubble_fraction(p, 4 * p)})


# --- tensor parallelism ---------------------------------------------------------------------------

def _tp_strategy_present() -> bool:
    """Whether this tree has the tp strategy (harness/strategies/tensor_parallel.py)."""
    from harness import strategies

    try:
        strategies.module("tp")
    except ModuleNotFoundError:
        return False
    return True


def _tp_cells(world_size: int) -> list[CellSpec]:
    return [cell("tp", world_size)] if _tp_strategy_present() else []


def _tp_params(r: Readings) -> Outcome:
    from harness import models
    from harness.predict import analytic_parallel, formulas

    c = cell("tp", r.world_size)
    spec = models.get_preset(c.model)
    numel, sharded = _layout(c).numel, analytic_parallel.tp_sharded_numel(spec)
    predicted = formulas.tp_model_states(sharded, numel - sharded, r.world_size).params
    details = {"sharded_numel": sharded, "replicated_numel": numel - sharded, "tp": r.world_size,
               "unsplit_params_bytes": 4 * numel}
    if not _tp_strategy_present():
        return Outcome(predicted=predicted, measured=None, verdict="not measurable here",
                       reason="the tp strategy (harness/strategies/tensor_parallel.py) is not in this tree", details=details)
    held = [p["at_optimizer_step_bytes"]["params"] for p in r.record(c)["per_rank"] if p.get("at_optimizer_step_bytes")]
    if not held:
        raise NotMeasurable(f"{c.cell_id}: no at_optimizer_step_bytes in the record", failed=True)
    return _compare(max(held), predicted, EXACT_TOL, details={**details, "per_rank_params_bytes": held})


# --- optimizer state ----------------------------------------------------------------------------

def _optimizer_bytes(r: Readings, c: CellSpec) -> float:
    held = [p["at_optimizer_step_bytes"]["optimizer"] for p in r.record(c)["per_rank"]
            if p.get("at_optimizer_step_bytes")]
    if not held:
        raise NotMeasurable(f"{c.cell_id}: no at_optimizer_step_bytes in the record", failed=True)
    return max(held)  # DDP: every rank holds the whole state


def _adamw8bit(r: Readings) -> Outcome:
    from harness import models
    from harness.predict.analytic_data_parallel import optimizer_state_bytes

    c8, c32 = r.cell("ddp", optimizer="adamw8bit"), r.cell("ddp")
    shapes = _layout(c8).shapes
    formula = optimizer_state_bytes(shapes, "adamw8bit") / optimizer_state_bytes(shapes, "adamw")
    big = models.param_layout(models.get_preset("gpt2-124m")).shapes
    at_scale = optimizer_state_bytes(big, "adamw8bit") / optimizer_state_bytes(big, "adamw")
    measured = _optimizer_bytes(r, c8) / _optimizer_bytes(r, c32)
    out = _compare(measured, formula, EXACT_TOL, details={
        "adamw8bit_bytes": _optimizer_bytes(r, c8), "adamw_bytes": _optimizer_bytes(r, c32),
        "formula_adamw8bit_bytes": optimizer_state_bytes(shapes, "adamw8bit"),
        "formula_adamw_bytes": optimizer_state_bytes(shapes, "adamw"),
        "formula_ratio_gpt2_124m": at_scale,
    }, note=(f"¼ at scale: the formula gives {at_scale:.3f} for GPT-2 124M; {formula:.3f} here, where tensors"
             " under 4,096 values keep 32-bit state"))
    if out.verdict == "holds" and abs(at_scale / 0.25 - 1) > 0.05:
        return dataclasses.replace(out, verdict="does not hold",
                                   reason=f"the formula gives {at_scale:.3f} for GPT-2 124M, not ¼")
    return out


def _adafactor(r: Readings) -> Outcome:
    from harness.predict.analytic_data_parallel import optimizer_state_bytes

    c = r.cell("ddp", optimizer="adafactor")
    shapes = _layout(c).shapes
    return _compare(_optimizer_bytes(r, c), optimizer_state_bytes(shapes, "adafactor"), EXACT_TOL,
                    details={"adamw_bytes": _optimizer_bytes(r, r.cell("ddp"))})


# --- gradient compression -----------------------------------------------------------------------

def _powersgd(rank: int) -> Callable[[Readings], Outcome]:
    def judge(r: Readings) -> Outcome:
        from harness.predict import formulas

        c = r.cell("ddp", compression="powersgd", powersgd_rank=rank)
        by_op = r.record(c)["metrics"].get("comm_by_op") or {}
        if "all_reduce" not in by_op:
            raise NotMeasurable(f"{c.cell_id}: no all_reduce counted", failed=True)
        shapes = _layout(c).shapes
        predicted = 4 * sum(formulas.powersgd_elements(s, rank) for s in shapes)
        ddp = _bytes_by_op(r.record(r.cell("ddp"))).get("all_reduce")
        return _compare(by_op["all_reduce"]["bytes"], predicted, EXACT_TOL, details={
            "all_reduce_count": by_op["all_reduce"]["count"], "ddp_all_reduce_bytes": ddp,
            "fraction_of_ddp": by_op["all_reduce"]["bytes"] / ddp if ddp else None})

    return judge


def _fp16_hook(r: Readings) -> Outcome:
    half = _bytes_by_op(r.record(r.cell("ddp", compression="fp16"))).get("all_reduce", 0)
    full = _bytes_by_op(r.record(r.cell("ddp"))).get("all_reduce", 0)
    if not full:
        raise NotMeasurable("the DDP cell counted no all_reduce", failed=True)
    return _compare(half / full, 0.5, EXACT_TOL, details={"fp16_hook_bytes": half, "ddp_bytes": full})


# --- precision (no cells) -----------------------------------------------------------------------

# formulas.md "Precision": max, smallest normal, smallest subnormal, eps (3 significant digits).
PRECISION_TABLE = {
    "fp16": {"max": 65504, "smallest_normal": 6.10e-5, "smallest_subnormal": 5.96e-8, "eps": 9.77e-4},
    "bf16": {"max": 3.39e38, "smallest_normal": 1.18e-38, "smallest_subnormal": 9.18e-41, "eps": 7.81e-3},
}
_PRINTED = 0.005  # 3 significant digits: within half a unit of the third


def _range(fmt: str) -> Callable[[Readings], Outcome]:
    def judge(r: Readings) -> Outcome:
        import torch

        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[fmt]
        info = torch.finfo(dtype)
        zero = torch.zeros((), dtype=dtype)
        measured = {"max": info.max, "smallest_normal": info.smallest_normal,
                    "smallest_subnormal": torch.nextafter(zero, torch.ones((), dtype=dtype)).item(), "eps": info.eps}
        ratios = {k: measured[k] / v for k, v in PRECISION_TABLE[fmt].items()}
        worst = max(ratios, key=lambda k: abs(ratios[k] - 1))
        ok = abs(ratios[worst] - 1) <= _PRINTED
        return Outcome(predicted=PRECISION_TABLE[fmt][worst], measured=measured[worst],
                       verdict="holds" if ok else "does not hold",
                       reason=f"furthest from the table: {worst}" if ok else f"{worst}: {measured[worst]:.3g}",
                       details={"torch": measured, "table": PRECISION_TABLE[fmt]})

    return judge


# A gradient far below fp16's smallest subnormal (5.96e-8): the upstream gradient of every
# output is 2^-30 ≈ 9.3e-10, the weight gradients up to ~1e-8.
_TINY_LOSS_FACTOR = 2.0**-30
_LOSS_SCALE = 2.0**24


def _loss_scaling(r: Readings) -> Outcome:
    import torch

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=generator)
    w0 = torch.randn(64, 64, generator=generator)

    def grads(dtype: torch.dtype | None, scale: float | None) -> torch.Tensor:
        w = torch.nn.Parameter(w0.clone())
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            y = x @ w
        loss = y.float().sum() * _TINY_LOSS_FACTOR
        scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, enabled=scale is not None)
        scaler.scale(loss).backward()
        scaler.unscale_(torch.optim.SGD([w], lr=0.0))  # a no-op when disabled
        return w.grad

    reference = grads(None, None)
    unscaled, scaled, bf16 = grads(torch.float16, None), grads(torch.float16, _LOSS_SCALE), grads(torch.bfloat16, None)
    nonzero = {name: float((g != 0).float().mean()) for name, g in
               (("fp16", unscaled), ("fp16_scaled", scaled), ("bf16", bf16), ("fp32", reference))}
    scaled_ratio = float(scaled.abs().sum() / reference.abs().sum())
    error = float((scaled - reference).abs().max() / reference.abs().max())
    ok = nonzero["fp16"] == 0.0 and nonzero["fp16_scaled"] == 1.0 and nonzero["bf16"] == 1.0 and error <= 1e-2
    return Outcome(
        predicted=1.0, measured=scaled_ratio, verdict="holds" if ok else "does not hold",
        reason=(f"nonzero gradients: fp16 {nonzero['fp16']:.0%}, fp16 with loss scale 2^24"
                f" {nonzero['fp16_scaled']:.0%} (max error {error:.1e} of the fp32 gradient),"
                f" bf16 {nonzero['bf16']:.0%}"),
        details={"nonzero_fraction": nonzero, "max_relative_error_scaled": error,
                 "largest_fp32_gradient": float(reference.abs().max()), "loss_scale": _LOSS_SCALE})


# --- ZeRO Table 1 (no cells) --------------------------------------------------------------------

TABLE_1_DEGREES = (1, 4, 16, 64, 256, 1024)
TABLE_1 = {  # Rajbhandari et al. 2020, Table 1: GB per device, K = 12, as printed
    (7.5e9, 1): ("120", "52.5", "35.6", "31.4", "30.4", "30.1"),
    (7.5e9, 2): ("120", "41.3", "21.6", "16.6", "15.4", "15.1"),
    (7.5e9, 3): ("120", "30", "7.5", "1.88", "0.47", "0.12"),
    (128e9, 1): ("2048", "896", "608", "536", "518", "513"),
    (128e9, 2): ("2048", "704", "368", "284", "263", "257"),
    (128e9, 3): ("2048", "512", "128", "32", "8", "2"),
    (1e12, 1): ("16000", "7000", "4750", "4187", "4046", "4011"),
    (1e12, 2): ("16000", "5500", "2875", "2218", "2054", "2013"),
    (1e12, 3): ("16000", "4000", "1000", "250", "62.5", "15.6"),
}


def _table_1(r: Readings) -> Outcome:
    from harness.predict import formulas

    misses, worst = [], 1.0
    for (psi, stage), row in TABLE_1.items():
        for degree, printed in zip(TABLE_1_DEGREES, row):
            gb = formulas.zero_model_states(psi, degree, stage).total / 1e9
            unit = 10.0 ** -len(printed.split(".")[1]) if "." in printed else 1.0  # last printed digit
            worst = max(worst, gb / float(printed), key=lambda x: abs(x - 1))
            if abs(gb - float(printed)) >= unit:
                misses.append(f"{psi:.3g} stage {stage} N_d={degree}: {gb:.4g} vs {printed}")
    entries = sum(len(row) for row in TABLE_1.values())
    return Outcome(predicted=float(entries), measured=float(entries - len(misses)),
                   verdict="does not hold" if misses else "holds",
                   reason="; ".join(misses) or f"every entry within one unit of its last printed digit"
                                                 f" (largest relative gap {abs(worst - 1):.2%}, rounding)",
                   details={"entries": entries, "misses": misses})


# --- the catalogue ----------------------------------------------------------------------------------

def _cells(*specs: tuple[str, dict]) -> Callable[[int], list[CellSpec]]:
    return lambda world_size: [cell(s, world_size, **o) for s, o in specs]


_ZERO = "Rajbhandari et al. 2020 (ZeRO)"
_KORTHIKANTI = "Korthikanti et al. 2022"
_CLAIMS: list[Claim] = []

for _s, (_stage, _title, _formula) in _MODEL_STATES.items():
    _CLAIMS.append(Claim(
        claim_id=f"model_states/{_s}", title=_title, source=f"{_ZERO} §5, Table 1",
        published=_STAGE_TEXT[_stage] + " (mixed precision: 2-byte params and grads, K = 12)",
        formula=_formula + "; analytic.model_states_at_step, per rank",
        tolerance=f"±{MODEL_STATES_TOL:.0%}, least rank (a rank can still hold a communication buffer in flight)",
        unit="bytes", judge=_model_states_claim(_s), cells=_cells((_s, {}))))

_CLAIMS.append(Claim(
    claim_id="comm_volume/ddp", title="DDP all-reduces the gradients: 2Ψ per step",
    source=f"{_ZERO} §7", published="data parallelism moves 2Ψ per step (reduce-scatter + all-gather)",
    formula="2 × 4Ψ bytes (fp32 gradients; an all-reduce counts twice)",
    tolerance=f"±{COMM_TOL:.0%}", unit="bytes", judge=_ddp_comm, cells=_cells(("ddp", {}))))
for _s, (_stage, _title) in _COMM.items():
    _CLAIMS.append(Claim(
        claim_id=f"comm_volume/{_s}", title=_title,
        source=f"{_ZERO} §7" + ("; Zhao et al. 2023 (FSDP) §3.2.1" if _s.startswith("fsdp") else ""),
        published="ZeRO-1/2 2Ψ = 1× DDP" if _stage < 3 else "ZeRO-3 3Ψ = 1.5× DDP",
        formula="volume(cell) / volume(DDP), volume = Σ bytes per op, all-reduce ×2 (analytic.comm_volume)",
        tolerance=f"±{COMM_TOL:.0%} (exact byte counts; padding and scalar flags only)", unit="× DDP",
        judge=_comm_claim(_s), cells=_cells((_s, {}), ("ddp", {}))))

_CLAIMS += [
    Claim(claim_id="activations/none", title="Activation bytes without recompute",
          source=f"{_KORTHIKANTI} §4.1-4.2, Table 2",
          published="s·b·h·(34 + 5·a·s/h) per layer (16-bit, dropout)",
          formula="L · [v·(8sbh + 2sbf) + 4asb] + 4sbV: v = 4 B (fp32), f = 4h, no dropout, SDPA keeps no"
                  " s×s scores (analytic.activation_bytes_per_layer), + the fp32 logits",
          tolerance=f"±{ACTIVATIONS_TOL:.0%}", unit="bytes", judge=_activations_none, cells=_cells(("ddp", {}))),
    Claim(claim_id="activations/full", title="Full recompute keeps only each layer's input",
          source=f"{_KORTHIKANTI} §4.3; Chen et al. 2016",
          published="2·s·b·h per layer (16-bit), one layer's activations recomputed at a time",
          formula="L·4sbh (fp32 layer inputs) + one layer recomputed during its backward (Table 2 row);"
                  " the loss and head have run their backward by then",
          tolerance=f"±{ACTIVATIONS_TOL:.0%}", unit="bytes", judge=_activations_full,
          cells=_cells(("ddp", {"checkpointing": "full"}), ("ddp", {}))),
    Claim(claim_id="activations/selective", title="Selective recompute: the harness's policy against the paper's",
          source=f"{_KORTHIKANTI} §4.3", published="s·b·h·34 per layer: the attention core (5as²b) recomputed",
          formula="Table 2 selective row with SDPA: the a·s² terms are already absent",
          tolerance="n/a (different policies)", unit="bytes", judge=_activations_selective,
          cells=_cells(("ddp", {"checkpointing": "selective"}), ("ddp", {}))),
    Claim(claim_id="activations/selective_70pct", title="Selective recompute saves 70% of activations on GPT-3 175B",
          source=f"{_KORTHIKANTI} §4.3, Table 2", published="70% less activation memory (TP 8 + SP)",
          formula="1 − 34/t ÷ (34/t + 5as/(ht)), s = 2048, h = 12288, a = 96, t = 8",
          tolerance="±0.5 percentage point (the paper rounds to whole %)", unit="fraction saved",
          judge=_selective_70),
    Claim(claim_id="activations/bf16_half", title="16-bit activations take half of fp32's",
          source=f"{_KORTHIKANTI} §4 (2-byte activations); Micikevicius et al. 2018",
          published="½ of fp32's activation bytes",
          formula="(L·per-layer(2 B) + fp32 logits) ÷ (L·per-layer(4 B) + fp32 logits)",
          tolerance=f"±{ACTIVATIONS_TOL:.0%}", unit="bf16 / fp32", judge=_activations_bf16,
          cells=_cells(("ddp", {"precision": "bf16"}), ("ddp", {}))),
    Claim(claim_id="activations/eager_scores", title="Eager attention keeps the s×s scores; fused attention does not",
          source=f"{_KORTHIKANTI} §4.1 (the 5as²b term); Dao et al. 2022 (FlashAttention)",
          published="the a·s² terms of s·b·h·(34 + 5·a·s/h) are the score matrix; fused kernels never store it",
          formula="L·(v·a·s²·b − 4·a·s·b): the fp32 softmax output eager keeps, less the fp32 log-sum-exp per row"
                  " SDPA keeps (no dropout: no mask, no dropout output); analytic.activation_bytes eager − sdpa",
          tolerance=f"±{EXACT_TOL:.0%}", unit="bytes", judge=_eager_scores,
          cells=_cells(("ddp", {"attention": "eager"}), ("ddp", {}))),
    Claim(claim_id="pipeline/bubble", title="The pipeline bubble is (p−1)/(m+p−1) of a step",
          source="Huang et al. 2019 (GPipe); Narayanan et al. 2021 §2.2",
          published="bubble ÷ ideal time (p−1)/m for GPipe and 1F1B, divided by v when interleaved",
          formula="analytic.pipeline_bubble_fraction(p, m) = (p−1)/(m+p−1); interleaved (p−1)/(v·m+p−1)",
          tolerance="n/a (not measured)", unit="fraction of the step", judge=_pipeline_bubble),
    Claim(claim_id="tensor_parallel/params_split", title="Tensor parallelism divides the split layers' parameters by t",
          source="Shoeybi et al. 2019 (Megatron-LM) §3",
          published="column- and row-parallel linear layers hold 1/t of their weights per rank; the rest is replicated",
          formula="4·(sharded/t + replicated) bytes of fp32 parameters per rank (analytic.tp_model_states,"
                  " analytic.tp_sharded_numel)",
          tolerance=f"±{EXACT_TOL:.0%}", unit="bytes", judge=_tp_params, cells=_tp_cells),
    Claim(claim_id="optimizer/adamw8bit_quarter", title="8-bit AdamW state is a quarter of AdamW's 32-bit moments",
          source="Dettmers et al. 2022", published="2 B/param against 8 B/param: 75% less",
          formula="analytic.optimizer_state_bytes: uint8 moments + fp32 absmax per 256 values; tensors < 4,096"
                  " values keep fp32 state",
          tolerance=f"±{EXACT_TOL:.0%} of the formula's ratio; the formula within 5% of ¼ at GPT-2 124M",
          unit="8-bit / 32-bit", judge=_adamw8bit,
          cells=_cells(("ddp", {"optimizer": "adamw8bit"}), ("ddp", {}))),
    Claim(claim_id="optimizer/adafactor_factored", title="Adafactor keeps a factored second moment, no first moment",
          source="Shazeer & Stern 2018", published="O(n + m) state for an n×m matrix",
          formula="analytic.optimizer_state_bytes: 4·(n + m) per matrix, 4·n per vector, + step",
          tolerance=f"±{EXACT_TOL:.0%}", unit="bytes", judge=_adafactor,
          cells=_cells(("ddp", {"optimizer": "adafactor"}), ("ddp", {}))),
    *(Claim(claim_id=f"compression/powersgd_r{rank}",
            title=f"PowerSGD rank {rank} all-reduces (m + n)·r per m×n gradient",
            source="Vogels et al. 2019; torch powerSGD_hook",
            published="m·n → (m + n)·r elements per compressed gradient",
            formula="4 · Σ analytic.powersgd_elements(shape, r) bytes (uncompressed when not worth it)",
            tolerance=f"±{EXACT_TOL:.0%}", unit="bytes", judge=_powersgd(rank),
            cells=_cells(("ddp", {"compression": "powersgd", "powersgd_rank": rank}), ("ddp", {})))
      for rank in (1, 4)),
    Claim(claim_id="compression/fp16_hook_half", title="fp16_compress_hook halves the all-reduce bytes",
          source="torch ddp_comm_hooks.default_hooks", published="½ of DDP's all-reduce bytes",
          formula="2Ψ bytes against 4Ψ", tolerance=f"±{EXACT_TOL:.0%}", unit="fp16 / fp32",
          judge=_fp16_hook, cells=_cells(("ddp", {"compression": "fp16"}), ("ddp", {}))),
    *(Claim(claim_id=f"precision/{fmt}_range", title=f"{fmt} range and precision",
            source="IEEE 754 / Google Brain bfloat16; formulas.md \"Precision\"",
            published=", ".join(f"{k} {v:.3g}" for k, v in PRECISION_TABLE[fmt].items()),
            formula="torch.finfo (max, smallest_normal, eps); nextafter(0, 1) for the smallest subnormal",
            tolerance="±0.5% (the table prints 3 significant digits)", unit="value", judge=_range(fmt))
      for fmt in ("fp16", "bf16")),
    Claim(claim_id="precision/fp16_loss_scaling", title="fp16 needs loss scaling; bf16 does not",
          source="Micikevicius et al. 2018 §3.2",
          published="gradients below 2^-24 flush to zero in fp16 unless the loss is scaled",
          formula="upstream gradient 2^-30 through an autocast matmul; GradScaler(init_scale=2^24) then unscale",
          tolerance="no fp16 gradient survives unscaled, every one scaled, error ≤ 1%",
          unit="Σ|scaled| / Σ|fp32|", judge=_loss_scaling),
    Claim(claim_id="zero/table1", title="ZeRO Table 1 recomputed from the model-state formulas",
          source=f"{_ZERO} Table 1", published="54 entries, GB per device, K = 12",
          formula="analytic.zero_model_states(Ψ, N_d, stage).total / 1e9",
          tolerance="one unit in the last printed digit", unit="entries", judge=_table_1),
]

# Claims that do not hold here, and why (checked against the records and the engines' code;
# see the module docstring).
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


def evaluate(claim_id: str, record_of: Callable[[CellSpec], dict | None], world_size: int) -> dict:
    """The claim record of one claim from a run's cell records."""
    claim = CLAIMS[claim_id]
    failed = False
    try:
        outcome = claim.judge(Readings(record_of, world_size))
    except NotMeasurable as why:
        outcome = Outcome(predicted=None, measured=None, verdict="not measurable here", reason=str(why))
        failed = why.failed
    reason = outcome.reason
    if outcome.verdict == "does not hold" and claim.deviation:
        reason = f"{claim.deviation} ({outcome.reason})" if outcome.reason else claim.deviation
    ratio = outcome.ratio
    return {
        "claim_id": claim.claim_id,
        "title": claim.title,
        "source": claim.source,
        "published": claim.published,
        "formula": claim.formula,
        "unit": claim.unit,
        "predicted": outcome.predicted,
        "measured": outcome.measured,
        "ratio": None if ratio is None or not math.isfinite(ratio) else ratio,
        "tolerance": claim.tolerance,
        "verdict": outcome.verdict,
        "reason": reason,
        "explained": bool(claim.deviation) and outcome.verdict == "does not hold",
        "cell_failed": failed,
        "world_size": world_size,
        "cells": [c.cell_id for c in claim.cells(world_size)],
        "details": outcome.details,
    }


def append_record(run_dir: Path, record: dict) -> None:
    """One line per claim in a single write, flushed and fsynced (as RunStore does for cells)."""
    line = json.dumps(record, default=float) + "\n"
    with (run_dir / CLAIMS_FILE).open("a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def load_records(run_dir: Path) -> list[dict]:
    """Every complete claim record of a run (the last per claim id); a truncated last line
    (a killed writer) is skipped."""
    path = run_dir / CLAIMS_FILE
    if not path.exists():
        return []
    out: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "claim_id" in record:
            out[record["claim_id"]] = record
    return list(out.values())


def format_value(value, unit: str) -> str:
    """A claim's predicted or measured value for a table."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if unit == "bytes":
        return f"{value:,.0f} B"
    if unit == "entries":
        return f"{value:.0f}"
    if unit == "value":
        return f"{value:.4g}"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.4g}"
