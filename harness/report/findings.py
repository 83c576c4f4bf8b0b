"""What a run found, one axis at a time: the run page's ``findings`` section, computed from
the records alone.

For every axis the run varied (``AXES``: sharding stage and engine, tensor parallelism's plan
options, precision, checkpointing, offload, accumulation, compression, optimizer, gradient
clipping, attention kernel, key/value heads, model, micro-batch, sequence length), the pairs
of ``ok`` cells that differ in that axis alone (every other field of the cell the same, the
warm-up apart, which follows the strategy), and for each value the effect against the
axis's baseline value, as cell ÷ baseline over the pairs:

- measured: peak memory per rank, step time, tokens/s, communication bytes per step;
- predicted beside it: the analytic peak, the predicted step time (and the tokens/s it
  implies), the analytic communication bytes.

An effect is the geometric mean of the pairs' ratios (a ratio and its inverse weigh the
same), with the smallest and largest pair beside it. Pairs *disagree* when the value lowers
a measure beyond ``AGREE`` in one pair and raises it beyond that in another (it helps one
model and hurts another, or one configuration and not another): the finding says so rather
than averaging it away.
"""

from __future__ import annotations

import copy
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from harness.markers import MODEL_FAMILIES

# Within these a ratio is "about the same": noise, not a direction (memory is exact on the
# CPU; step times of the same cell move by several percent from run to run on a busy host).
AGREE = {"peak": 0.05, "step": 0.10, "tokens": 0.10, "comm": 0.05}
_HEADS = ("mha", "gqa", "mqa")


def _strategy(cell: dict) -> str:
    return cell["strategy"]["name"]


def _strategy_name(record: dict) -> str:
    """``fsdp_full (ZeRO-3)``: the strategy and the ZeRO stage it implements, if any."""
    idea = record.get("zero_idea")
    return _strategy(record["cell"]) + (f" (ZeRO-{idea.removeprefix('zero')})" if idea else "")


def _compression(cell: dict) -> str:
    s = cell["strategy"]
    return f"compress_{s['compression']}" + (f"-r{s['powersgd_rank']}" if s["compression"] == "powersgd" else "")


def _clipping(record: dict) -> str:
    clip = record["cell"]["strategy"].get("clip_grad_norm")  # absent from records before the option
    return "clip_none" if clip is None else f"clip{clip:g}"


def _tensor_parallel_plan(record: dict) -> str:
    """The plan options a tensor-parallel cell splits with, as its cell id tags them (absent
    from records before the options: none)."""
    strategy = record["cell"]["strategy"]
    tags = [tag for tag, option in (("sp", "sequence_parallel"), ("lossp", "loss_parallel")) if strategy.get(option)]
    return "/".join(tags) or "plan_blocks_only"


def _heads(record: dict) -> str | None:
    return next((m for m in record.get("markers") or () if m in _HEADS), None)


def _model(record: dict) -> str:
    return (record.get("model") or {}).get("name") or "?"


def _family(record: dict) -> str | None:
    return next((m for m in record.get("markers") or () if m in MODEL_FAMILIES), None)


@dataclass(frozen=True)
class Axis:
    key: str  # element ids and figure file names
    title: str
    owns: tuple[str, ...]  # the cell fields it varies ("strategy.name"): left out of the pairing key
    value: Callable[[dict], str | None]  # a record's value on this axis (None: not on it)
    baselines: tuple[str, ...] = ()  # the baseline, first found in the run; else the most common value
    same_family: bool = False  # pair only cells of one model family (key/value heads)
    display: Callable[[dict], str] | None = None  # a value's name in sentences (default: the value)

    def name(self, record: dict) -> str:
        return self.display(record) if self.display else str(self.value(record))


STRATEGY = Axis("strategy", "sharding stage and engine",
                ("strategy.name", "strategy.hsdp_mesh", "strategy.tp_degree", "strategy.pp_degree",
                 "strategy.pp_microbatches"),
                lambda r: _strategy(r["cell"]), ("ddp",), display=_strategy_name)
AXES: tuple[Axis, ...] = (
    STRATEGY,
    Axis("tp_plan", "tensor-parallel plan options", ("strategy.sequence_parallel", "strategy.loss_parallel"),
         _tensor_parallel_plan, ("plan_blocks_only",)),
    Axis("precision", "precision", ("strategy.precision",), lambda r: r["cell"]["strategy"]["precision"], ("fp32",)),
    Axis("checkpointing", "activation checkpointing", ("strategy.checkpointing",),
         lambda r: f"ckpt_{r['cell']['strategy']['checkpointing']}", ("ckpt_none",)),
    Axis("offload", "offload", ("strategy.offload",), lambda r: f"offload_{r['cell']['strategy']['offload']}",
         ("offload_none",)),
    Axis("accumulation", "gradient accumulation", ("strategy.accumulation",),
         lambda r: f"accum{r['cell']['strategy']['accumulation']}", ("accum1",)),
    Axis("compression", "gradient compression", ("strategy.compression", "strategy.powersgd_rank"),
         lambda r: _compression(r["cell"]), ("compress_none",)),
    Axis("optimizer", "optimizer", ("strategy.optimizer",), lambda r: r["cell"]["strategy"]["optimizer"], ("adamw",)),
    Axis("clipping", "gradient clipping", ("strategy.clip_grad_norm",), _clipping, ("clip_none",)),
    Axis("attention", "attention kernel", ("attention",), lambda r: f"attn_{r['cell']['attention']}", ("attn_sdpa",)),
    Axis("heads", "key/value heads", ("model",), _heads, ("mha",), same_family=True),
    Axis("model", "model", ("model",), _model),
    Axis("micro_batch", "micro-batch", ("micro_batch",), lambda r: f"mb{r['cell']['micro_batch']}"),
    Axis("seq_len", "sequence length", ("seq_len",),
         lambda r: "seq default" if r["cell"]["seq_len"] is None else f"seq{r['cell']['seq_len']}"),
)

# What a pair compares: name -> (a record's measured value, its predicted value).
_MEASURES: dict[str, tuple[Callable[[dict], float | None], Callable[[dict], float | None]]] = {
    "peak": (lambda r: r["metrics"].get("peak_mem_bytes"),
             lambda r: ((r.get("predicted") or {}).get("analytic") or {}).get("peak_bytes")),
    "step": (lambda r: r["metrics"].get("step_time_s"),
             lambda r: (r.get("predicted") or {}).get("step_time_s")),
    "tokens": (lambda r: r["metrics"].get("tokens_per_s"), lambda r: _predicted_tokens_per_s(r)),
    "comm": (lambda r: r["metrics"].get("comm_bytes_per_step"),
             lambda r: ((r.get("predicted") or {}).get("analytic") or {}).get("comm_bytes_per_step")),
}
MEASURES = tuple(_MEASURES)


def _predicted_tokens_per_s(record: dict) -> float | None:
    """The step's tokens (as measured: tokens/s × step time) over the predicted step time."""
    m, predicted = record["metrics"], (record.get("predicted") or {}).get("step_time_s")
    if not (m.get("tokens_per_s") and m.get("step_time_s") and predicted):
        return None
    return m["tokens_per_s"] * m["step_time_s"] / predicted


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b and a > 0 else None


def pairing_key(record: dict, axis: Axis) -> str:
    """The cell but for what ``axis`` varies (and the warm-up, which follows the strategy):
    two records with the same key differ in that axis alone."""
    cell = copy.deepcopy(record["cell"])
    cell.pop("warmup", None)
    for path in axis.owns:
        *parents, leaf = path.split(".")
        holder = cell
        for part in parents:
            holder = holder[part]
        holder.pop(leaf, None)
    if axis.same_family:
        cell["family"] = _family(record)
    return json.dumps(cell, sort_keys=True)


@dataclass(frozen=True)
class Pair:
    cell_id: str
    baseline_id: str
    model: str
    measured: dict[str, float | None]
    predicted: dict[str, float | None]


@dataclass(frozen=True)
class Effect:
    """One measure of one value against the baseline, over the pairs."""
    measured: float | None  # geometric mean of the pairs' ratios
    low: float | None
    high: float | None
    predicted: float | None
    disagree: tuple[list[str], list[str]] | None  # (the model of each pair it lowers, … it raises)


@dataclass(frozen=True)
class Finding:
    axis: Axis
    value: str
    baseline: str
    pairs: list[Pair]
    effects: dict[str, Effect]
    sentence: str


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _effect(pairs: list[Pair], measure: str) -> Effect:
    measured = [(r, p.model) for p in pairs if (r := p.measured[measure]) is not None]
    predicted = [r for p in pairs if (r := p.predicted[measure]) is not None]
    ratios = [r for r, _ in measured]
    lowers = [model for r, model in measured if r < 1 - AGREE[measure]]
    raises = [model for r, model in measured if r > 1 + AGREE[measure]]
    return Effect(measured=_geomean(ratios), low=min(ratios, default=None), high=max(ratios, default=None),
                  predicted=_geomean(predicted), disagree=(lowers, raises) if lowers and raises else None)


def _disagreement(effect: Effect, what: str) -> str:
    assert effect.disagree is not None and effect.low is not None and effect.high is not None
    lowers, raises = effect.disagree
    if not set(lowers) & set(raises):  # the models part: name them
        return (f" The pairs disagree on the {what}: lower for {', '.join(sorted(set(lowers)))},"
                f" higher for {', '.join(sorted(set(raises)))}.")
    return (f" The pairs disagree on the {what}: lower in {len(lowers)}, higher in {len(raises)}"
            f" ({_x(effect.low)} to {_x(effect.high)}).")


def _x(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}×"


def _sentence(value: str, baseline: str, effects: dict[str, Effect], n: int) -> str:
    peak, step, comm = effects["peak"], effects["step"], effects["comm"]
    text = f"{value} held {_x(peak.measured)} {baseline}'s peak per rank at {_x(step.measured)} its step time"
    if comm.measured is not None:
        text += f", moving {_x(comm.measured)} its bytes a step"
    text += f" over {n} pair{'s' if n != 1 else ''}"
    predicted = [f"{_x(e.predicted)} the {what}" for e, what in ((peak, "peak"), (step, "step time"))
                 if e.predicted is not None]
    text += f"; the predictors say {' and '.join(predicted)}." if predicted else "."
    return text + "".join(_disagreement(e, what) for e, what in ((peak, "peak"), (step, "step time")) if e.disagree)


def _baseline(axis: Axis, values: Counter[str]) -> str:
    for preferred in axis.baselines:
        if preferred in values:
            return preferred
    # Else the value most cells have (it pairs with the most), ties by name: deterministic.
    return min(values, key=lambda v: (-values[v], v))


def axis_findings(records: list[dict], axis: Axis) -> list[Finding]:
    """The findings of one axis: one per value other than the baseline that has a pair."""
    ok = [r for r in records if r.get("status") == "ok" and r.get("metrics") and r.get("cell")
          and axis.value(r) is not None]
    groups: dict[str, list[dict]] = {}
    for r in ok:
        groups.setdefault(pairing_key(r, axis), []).append(r)
    varied = {k: g for k, g in groups.items() if len({axis.value(r) for r in g}) > 1}
    if not varied:
        return []
    baseline = _baseline(axis, Counter(str(axis.value(r)) for g in varied.values() for r in g))
    by_value: dict[str, list[Pair]] = {}
    for group in varied.values():
        bases = [r for r in group if axis.value(r) == baseline]
        for base in bases[:1]:  # one baseline cell per pairing key (a repeated cell is one record)
            for r in group:
                value = axis.value(r)
                if value == baseline or value is None:
                    continue
                by_value.setdefault(value, []).append(Pair(
                    cell_id=r["cell_id"], baseline_id=base["cell_id"], model=_model(r),
                    measured={k: _ratio(m(r), m(base)) for k, (m, _) in _MEASURES.items()},
                    predicted={k: _ratio(p(r), p(base)) for k, (_, p) in _MEASURES.items()}))
    names = {axis.value(r): axis.name(r) for r in ok}
    findings = []
    for value in sorted(by_value):
        pairs = by_value[value]
        effects = {k: _effect(pairs, k) for k in MEASURES}
        findings.append(Finding(axis=axis, value=value, baseline=baseline, pairs=pairs, effects=effects,
                                sentence=_sentence(names[value], names[baseline], effects, len(pairs))))
    return findings


def run_findings(records: list[dict]) -> list[tuple[Axis, list[Finding]]]:
    """Every axis the run varied with its findings, in ``AXES`` order."""
    return [(axis, found) for axis in AXES if (found := axis_findings(records, axis))]


def per_model(found: list[Finding]) -> list[dict]:
    """An axis's findings model by model (its figure's panels): {model, value, peak, step},
    each the geometric mean of that model's pairs."""
    rows = []
    for finding in found:
        for model in sorted({p.model for p in finding.pairs}):
            pairs = [p for p in finding.pairs if p.model == model]
            rows.append({"model": model, "value": finding.value, **{
                measure: _geomean([r for p in pairs if (r := p.measured[measure]) is not None])
                for measure in ("peak", "step")}})
    return rows
