"""The report's section on the real-data cells (``id="convergence"``): each cell's final
held-out loss against the fp32 seeds' band (harness/convergence.py), a figure per model of the
held-out loss over training, and the BatchNorm table (``id="batch_norm"``,
harness/measure/batch_norm.py): what each BatchNorm cell normalised over, its running
statistics against the whole-batch run's, and its held-out accuracy beside that run's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import convergence
from harness.config import CellSpec
from harness.measure import batch_norm
from harness.report import figures
from harness.report.figures import safe_name


def section(records: list[dict], fig_dir: Path, jobs: list[figures.Job],
            page_of: Callable[[str], str]) -> dict | None:
    """The section's rows and figures (each figure a job added to ``jobs``; ``page_of``: a cell
    id's page); None without real-data cells."""
    by_id = {r["cell_id"]: r for r in records}
    cells = [(r, CellSpec.from_dict(r["cell"])) for r in records if r.get("evaluation")]
    if not cells:
        return None

    def record_of(cell: CellSpec) -> dict | None:
        return by_id.get(cell.cell_id)

    rows: list[dict[str, Any]] = []
    curves_of: dict[str, list[dict[str, Any]]] = {}  # by model
    for record, cell in cells:
        judged = convergence.verdict(cell, record_of)
        if judged is None:
            continue
        curves_of.setdefault(cell.model_name, []).append({
            "label": _label(cell), "panel": _precision_label(cell), "points": record["evaluation"]["held_out_loss"],
            "fp32_reference": _is_fp32_reference(cell)})
        rows.append({"cell_id": record["cell_id"], "page": page_of(record["cell_id"]),
                     "final": _fixed(judged["final_held_out_loss"]),
                     "reference": _fixed(judged["fp32_by_seed"].get(cell.seed)),
                     "difference": _fixed(judged["difference"], sign=True), "tolerance": _fixed(judged["tolerance"]),
                     "verdict": judged["verdict"], "reason": judged["reason"]})
    plotted = []
    for model, curves in curves_of.items():
        name = f"convergence-{safe_name(model)}.svg"
        jobs.append((figures.convergence_figure, (curves, fig_dir / name)))
        plotted.append({"model": model, "path": f"{fig_dir.name}/{name}"})
    return {"rows": rows, "figures": plotted, "seeds": ", ".join(map(str, convergence.SEEDS)),
            "batch_norm": batch_norm_rows(records, record_of, page_of)}


def batch_norm_rows(records: list[dict], record_of: Callable[[CellSpec], dict | None],
                    page_of: Callable[[str], str]) -> list[dict[str, Any]]:
    """A row per real-data cell of a model with BatchNorm (those that did not run too, with
    why), against the fp32 one-process whole-batch run of its seed."""
    rows = []
    for record in records:
        cell = CellSpec.from_dict(record["cell"])
        if cell.data == "synthetic" or not cell.model_spec.has_batch_norm:
            continue
        whole = record_of(convergence.fp32_reference(cell, cell.seed))
        mine, theirs = record.get("batch_norm"), (whole or {}).get("batch_norm")
        apart = batch_norm.difference(mine, theirs) if mine and theirs else {}
        rows.append({
            "cell_id": record["cell_id"], "page": page_of(record["cell_id"]), "status": record["status"],
            "reason": record.get("reason") or "", "how": _how(cell),
            "normalised_over": f"{batch_norm.statistics_batch(cell)} of {cell.global_batch}",
            "mean_apart": _percent(apart.get("running_mean")), "var_apart": _percent(apart.get("running_var")),
            "accuracy": _percent(_final_accuracy(record)), "whole_batch_accuracy": _percent(_final_accuracy(whole)),
        })
    return rows


def _how(cell: CellSpec) -> str:
    s = cell.strategy
    parts = [f"{s.name} on {cell.world_size} rank{'s' if cell.world_size > 1 else ''}"]
    if s.sync_batch_norm:
        parts.append("SyncBatchNorm")
    if s.accumulation > 1:
        parts.append(f"a virtual batch of {s.accumulation} micro-steps")
    return ", ".join(parts)


def _final_accuracy(record: dict | None) -> float | None:
    if not record or record.get("status") != "ok":
        return None
    points = (record.get("evaluation") or {}).get("held_out_accuracy") or []
    return points[-1][1] if points else None


def _is_fp32_reference(cell: CellSpec) -> bool:
    return cell == convergence.fp32_reference(cell, cell.seed)


def _label(cell: CellSpec) -> str:
    s = cell.strategy
    extra = [f"accum{s.accumulation}"] if s.accumulation > 1 else []
    extra += ["SyncBN"] if s.sync_batch_norm else []
    return f"{s.name}{' ' + ' '.join(extra) if extra else ''} (seed {cell.seed})"


def _precision_label(cell: CellSpec) -> str:
    s = cell.strategy
    return s.precision + (f", loss scaling {s.loss_scaling}" if s.loss_scaling != "dynamic" else "")


def _fixed(value: float | None, sign: bool = False) -> str:
    return "-" if value is None else (f"{value:+.4f}" if sign else f"{value:.4f}")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"
