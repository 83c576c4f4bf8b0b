"""``python -m harness plan``: will a configuration fit, before renting the GPUs?

For one model, GPU count and memory budget, every strategy and sensible option combination
(activation checkpointing, offload) at the chosen precision and optimizer, with the analytic
predictor's peak per GPU and its breakdown, whether it fits, the communication per step, and
a recommendation: the first fitting row in the order a practitioner would try them — no
offload before offload (host memory and PCIe are slow), less recomputation before more,
fewer bytes moved per step before more.

``--traced`` also traces the recommended configuration (harness/predict/traced.py), for
models up to about 10B parameters on a CPU host: exact per-category peak of the real model
and strategy under FakeTensorMode, at the real world size.
"""

from __future__ import annotations

import dataclasses
import json

from harness import models, strategies
from harness.config import CellSpec, Checkpointing, Offload, Optimizer, Precision, StrategySpec
from harness.predict import analytic

# The data-parallel and sharded strategies the formulas describe, as their engines'
# maintainers recommend them (no superseded engine), the reference aside.
PLANNED_STRATEGIES = tuple(s.name for s in strategies.declarations()
                           if s.engine_model.analytic == "data_parallel" and s.superseded_by is None
                           and s.splits_batch and "reference" not in s.families)
CHECKPOINTING_ORDER: tuple[Checkpointing, ...] = ("none", "selective", "full")
OFFLOAD_ORDER: tuple[Offload, ...] = ("none", "params", "optimizer", "optimizer_params")
@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str | models.ModelSpec  # a preset's name, or a resolved config (harness.models.sources)
    gpus: int
    gpu_mem_bytes: float
    nodes: int = 1
    seq: int | None = None
    micro_batch: int = 1
    precision: Precision = "bf16"
    optimizer: Optimizer = "adamw"

    def __post_init__(self) -> None:
        if isinstance(self.model, str):
            models.get_preset(self.model)  # raises with the allowed names
        if self.gpus < 1:
            raise ValueError(f"--gpus {self.gpus}: must be at least 1")
        if self.nodes < 1 or self.gpus % self.nodes:
            raise ValueError(f"--gpus {self.gpus} is not divisible by --nodes {self.nodes}:"
                             " every node runs the same number of GPUs")
        if self.micro_batch < 1:
            raise ValueError(f"--micro-batch {self.micro_batch}: must be at least 1")
        if self.seq is not None and self.seq < 1:
            raise ValueError(f"--seq {self.seq}: must be at least 1")
        spec = self.model if isinstance(self.model, models.ModelSpec) else models.get_preset(self.model)
        if self.seq is not None and spec.seq_len is None:
            raise ValueError(f"--seq applies to text models; {spec.name} is a {spec.family} model")

    @property
    def spec(self) -> models.ModelSpec:
        spec = self.model if isinstance(self.model, models.ModelSpec) else models.get_preset(self.model)
        return dataclasses.replace(spec, seq_len=self.seq) if self.seq else spec


def candidates(req: PlanRequest) -> list[CellSpec]:
    """Every planned strategy × checkpointing × offload the strategy composes with."""
    cells = []
    for name in PLANNED_STRATEGIES:
        if name == "fsdp_hybrid" and req.nodes < 2:
            continue  # on one node HSDP is full sharding with a trivial replicate dimension
        for ckpt in CHECKPOINTING_ORDER:
            for offload in OFFLOAD_ORDER:
                try:
                    strategy = StrategySpec(name=name, precision=req.precision, checkpointing=ckpt,
                                            offload=offload, optimizer=req.optimizer)
                    cell = CellSpec(model=req.model, strategy=strategy, micro_batch=req.micro_batch,
                                    world_size=req.gpus, seq_len=req.seq)
                except ValueError:
                    continue
                if req.gpus >= 2 and strategies.incompatibility(cell) is None:
                    cells.append(cell)
    return cells


def _preference(row: dict) -> tuple:
    s = row["cell"].strategy
    return (OFFLOAD_ORDER.index(s.offload), CHECKPOINTING_ORDER.index(s.checkpointing),
            row["predicted"]["comm_volume_per_step"], row["predicted"]["peak_bytes"])


def plan(req: PlanRequest) -> dict:
    rows = []
    for cell in candidates(req):
        predicted = analytic.predict(cell, nodes=req.nodes)
        rows.append({"cell": cell, "predicted": predicted,
                     "fits": predicted["peak_bytes"] <= req.gpu_mem_bytes})
    fitting = sorted((r for r in rows if r["fits"]), key=_preference)
    return {"request": req, "rows": sorted(rows, key=lambda r: r["predicted"]["peak_bytes"]),
            "recommended": fitting[0] if fitting else None}


def recommendation_text(result: dict) -> str:
    req, best = result["request"], result["recommended"]
    if best is None:
        smallest = result["rows"][0] if result["rows"] else None
        need = (f"; the smallest predicted peak is {_gib(smallest['predicted']['peak_bytes'])}"
                f" ({_label(smallest['cell'])})" if smallest else "")
        return (f"Nothing fits {_gib(req.gpu_mem_bytes)} per GPU{need}: add GPUs, shorten the sequence,"
                " or lower the micro-batch.")
    s = best["cell"].strategy
    return (f"Recommended: {_label(best['cell'])}: predicted peak {_gib(best['predicted']['peak_bytes'])} of"
            f" {_gib(req.gpu_mem_bytes)}, {_gib(best['predicted']['comm_volume_per_step'])} moved per GPU per step."
            + ("" if s.offload == "none" else " Offload costs host-device bandwidth every step.")
            + ("" if s.checkpointing == "none"
               else f" {s.checkpointing.capitalize()} checkpointing trades compute for memory."))


def _label(cell: CellSpec) -> str:
    s = cell.strategy
    parts = [s.name, s.precision, f"ckpt_{s.checkpointing}"]
    if s.offload != "none":
        parts.append(f"offload_{s.offload}")
    return "/".join(parts)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def as_json(result: dict, traced: dict | None = None) -> str:
    req = result["request"]
    return json.dumps({
        "request": {**dataclasses.asdict(req), "model": spec_json(req.model)},
        "rows": [{"config": _label(r["cell"]), "cell": r["cell"].to_dict(), "fits": r["fits"],
                  "predicted": r["predicted"]} for r in result["rows"]],
        "recommended": _label(result["recommended"]["cell"]) if result["recommended"] else None,
        "recommendation": recommendation_text(result),
        "traced": traced,
    }, indent=2)


def spec_json(model: str | models.ModelSpec) -> str | dict:
    return model.to_dict() if isinstance(model, models.ModelSpec) else model


def as_table(result: dict, markdown: bool, traced: dict | None = None) -> str:
    req = result["request"]
    spec = req.spec
    head = (f"{spec.name}: {models.param_layout(spec).numel / 1e9:.2f}B parameters, seq {spec.tokens_per_sample},"
            f" micro-batch {req.micro_batch}, {req.gpus} GPUs on {req.nodes} node(s), {_gib(req.gpu_mem_bytes)} each,"
            f" {req.precision}, {req.optimizer}. Analytic predictor (harness/predict/analytic.py); per GPU.")
    cols = ("config", "fits", "peak", "params", "grads", "optimizer", "buffers", "activations", "transient",
            "offloaded", "comm/step")
    lines = [head, ""]
    if markdown:
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    else:
        lines.append(f"{cols[0]:<52} {cols[1]:<4} " + " ".join(f"{c:>11}" for c in cols[2:]))
    for r in result["rows"]:
        p = r["predicted"]
        st = p["model_states_bytes"]
        values = [p["peak_bytes"], st["params"], st["grads"], st["optimizer"], st["buffers"],
                  p["activation_bytes"]["layers"] + p["activation_bytes"]["logits"],
                  sum(p["transient_bytes"].values()), sum(p["offloaded_bytes"].values()),
                  p["comm_volume_per_step"]]
        fits = "yes" if r["fits"] else "no"
        cells = [_gib(v).replace(" GiB", "") for v in values]
        if markdown:
            lines.append(f"| {_label(r['cell'])} | {fits} | " + " | ".join(cells) + " |")
        else:
            lines.append(f"{_label(r['cell']):<52} {fits:<4} " + " ".join(f"{c:>11}" for c in cells))
    lines += ["", "(GiB; comm/step: bytes each GPU moves per step, an all-reduce counted twice as in ZeRO §7)",
              "", recommendation_text(result)]
    if traced is not None:
        lines.append(f"Traced (FakeTensorMode) for the recommendation: {_traced_text(traced)}")
    return "\n".join(lines)


def _traced_text(traced: dict) -> str:
    if "peak_bytes" not in traced:
        return f"unavailable: {traced.get('unavailable', '?')}"
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in traced["breakdown_bytes"].items())
    return f"peak {_gib(traced['peak_bytes'])} ({parts})"
