"""The report's figures: matplotlib/seaborn (Agg) rendered once, at report time, into SVG
files inside the report folder. Only ``ok`` cells are plotted; every figure is faceted by
model (one file per model) so different models never share an axis."""

from __future__ import annotations

import math
import multiprocessing
import os
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display, no GUI toolkit: files only

import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import pandas as pd
import seaborn as sns

# Text stays text (small files, selectable, searchable); a fixed hash salt and no date keep
# the SVG a pure function of the results.
plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "shardbench", "font.size": 9})
_SVG_META = {"Date": None}

MEM_CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
Job = tuple[Callable[..., Any], tuple]  # a figure to draw: a module-level function and its arguments
MIB = 2**20


def safe_name(text: str) -> str:
    """A file-name-safe form of a cell id or model name (``/`` and friends become ``_``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "x"


def short_label(record: dict) -> str:
    """A cell id without its model (figures are per model already)."""
    cell_id = record["cell_id"]
    model = (record.get("model") or {}).get("name")
    if model and cell_id.startswith(model + "/"):
        return cell_id[len(model) + 1:]
    return cell_id


def ok_frame(records: list[dict]) -> pd.DataFrame:
    """One row per ok cell that has metrics: the numbers the figures need."""
    rows = []
    for r in records:
        m = r.get("metrics") or {}
        if r.get("status") != "ok" or not m:
            continue
        breakdown = m.get("mem_breakdown_bytes") or {}
        rows.append({
            "cell_id": r["cell_id"],
            "model": (r.get("model") or {}).get("name") or "?",
            "label": short_label(r),
            "peak_mib": (m.get("peak_mem_bytes") or 0) / MIB,
            "tokens_per_s": m.get("tokens_per_s"),
            **{f"mem_{c}": (breakdown.get(c) or 0) / MIB for c in MEM_CATEGORIES},
        })
    return pd.DataFrame(rows)


def _save(fig, path: Path, tight: bool = True) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    # A tight bounding box renders twice: worth it for labels of unknown length, not for the
    # fixed layout of the (many) per-cell figures.
    fig.savefig(path, format="svg", bbox_inches="tight" if tight else None, metadata=_SVG_META)
    plt.close(fig)
    return path.name


def _height(n: int) -> float:
    return max(2.2, 0.9 + 0.22 * n)


def _memory(df: pd.DataFrame, model: str, path: Path) -> None:
    d = df.sort_values("peak_mib")
    fig, ax = plt.subplots(figsize=(8, _height(len(d))))
    left = pd.Series(0.0, index=d.index)
    colors = sns.color_palette("colorblind", len(MEM_CATEGORIES))
    for category, color in zip(MEM_CATEGORIES, colors):
        ax.barh(d["label"], d[f"mem_{category}"], left=left, color=color, label=category)
        left = left + d[f"mem_{category}"]
    ax.scatter(d["peak_mib"], d["label"], marker="|", color="black", s=60, label="peak (max over ranks)", zorder=3)
    ax.set_xlabel("MiB per rank")
    ax.set_title(f"{model}: peak memory per rank by category")
    ax.invert_yaxis()
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    _save(fig, path)


def _throughput(df: pd.DataFrame, model: str, path: Path) -> None:
    d = df.dropna(subset=["tokens_per_s"]).sort_values("tokens_per_s", ascending=False)
    fig, ax = plt.subplots(figsize=(8, _height(len(d))))
    sns.barplot(data=d, y="label", x="tokens_per_s", ax=ax, color=sns.color_palette("colorblind")[0])
    ax.set_xlabel("tokens/s (all ranks)")
    ax.set_ylabel("")
    ax.set_title(f"{model}: throughput")
    _save(fig, path)


def _comm(records: list[dict], model: str, path: Path) -> bool:
    rows = []
    for r in records:
        for op, v in ((r.get("metrics") or {}).get("comm_by_op") or {}).items():
            rows.append({"label": short_label(r), "op": op, "MiB": (v.get("bytes") or 0) / MIB,
                         "ms": (v.get("time_s") or 0) * 1e3})
    if not rows:
        return False
    d = pd.DataFrame(rows)
    byte_table = d.pivot_table(index="label", columns="op", values="MiB", aggfunc="sum", fill_value=0)
    time_table = d.pivot_table(index="label", columns="op", values="ms", aggfunc="sum", fill_value=0)
    order = byte_table.sum(axis=1).sort_values().index
    fig, axes = plt.subplots(1, 2, figsize=(11, _height(len(order))), sharey=True)
    colors = sns.color_palette("colorblind", len(byte_table.columns))
    # pandas-stubs type ``color`` as a list of a union (invariant): a palette of RGB tuples is one.
    byte_table.loc[order].plot.barh(stacked=True, ax=axes[0], color=colors, legend=False)  # type: ignore[arg-type]
    time_table.loc[order, byte_table.columns].plot.barh(stacked=True, ax=axes[1], color=colors)  # type: ignore[arg-type]
    axes[0].set_xlabel("MiB per step")
    axes[1].set_xlabel("ms per step")
    axes[0].set_ylabel("")
    axes[1].legend(title="collective", fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(f"{model}: communication per step by collective")
    _save(fig, path)
    return True


def pareto_front(df: pd.DataFrame) -> pd.DataFrame:
    """Cells no other cell beats on both low memory and high throughput."""
    d = df.dropna(subset=["tokens_per_s"]).sort_values(["peak_mib", "tokens_per_s"], ascending=[True, False])
    best, keep = float("-inf"), []
    for index, row in d.iterrows():
        if row["tokens_per_s"] > best:
            keep.append(index)
            best = row["tokens_per_s"]
    return d.loc[keep]


def _scatter(df: pd.DataFrame, model: str, path: Path) -> None:
    d = df.dropna(subset=["tokens_per_s"])
    front = pareto_front(d)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter(d["peak_mib"], d["tokens_per_s"], color="0.6", s=18, label="cell")
    ax.plot(front["peak_mib"], front["tokens_per_s"], "o-", color="#c0392b", label="Pareto front")
    for _, row in front.iterrows():
        ax.annotate(row["label"], (row["peak_mib"], row["tokens_per_s"]), fontsize=6,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("peak MiB per rank (lower is better)")
    ax.set_ylabel("tokens/s (higher is better)")
    ax.set_title(f"{model}: memory vs throughput")
    ax.legend(fontsize=7)
    _save(fig, path)


def _losses(records: list[dict], by_id: dict[str, dict], model: str, path: Path) -> bool:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn_refs, any_line = set(), False
    for r in records:
        losses = r.get("losses") or []
        if not losses:
            continue
        ref_id = (r.get("equivalence") or {}).get("reference_cell_id")
        if ref_id is None:
            continue
        ax.plot(range(len(losses)), losses, lw=0.8, alpha=0.6)
        any_line = True
        ref = by_id.get(ref_id)
        if ref and ref.get("losses") and ref_id not in drawn_refs:
            ax.plot(range(len(ref["losses"])), ref["losses"], color="black", lw=2, ls="--",
                    label=f"reference {short_label(ref)}")
            drawn_refs.add(ref_id)
    if not any_line:
        plt.close(fig)
        return False
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{model}: loss of every strategy (thin) over its reference (dashed)")
    if drawn_refs:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(fig, path)
    return True


def _step_times(records: list[dict], model: str, path: Path) -> bool:
    rows = [{"label": short_label(r), "ms": t * 1e3}
            for r in records for rank in (r.get("per_rank") or []) for t in (rank.get("step_times_s") or [])
            if t is not None]
    if not rows:
        return False
    d = pd.DataFrame(rows)
    order = d.groupby("label")["ms"].median().sort_values().index
    fig, ax = plt.subplots(figsize=(8, _height(len(order))))
    color = sns.color_palette("colorblind")[2]
    ax.boxplot([d.loc[d["label"] == label, "ms"] for label in order], orientation="horizontal",
               tick_labels=list(order), patch_artist=True, boxprops={"facecolor": color, "alpha": 0.7},
               medianprops={"color": "black"}, flierprops={"markersize": 2})
    ax.invert_yaxis()
    ax.set_xlabel("step time, ms (every measured step of every rank)")
    ax.set_ylabel("")
    ax.set_title(f"{model}: step time distribution")
    _save(fig, path)
    return True


def axis_figure(title: str, baseline: str, rows: list[dict], path: Path) -> None:
    """One axis of the findings as small multiples: a panel per model, in it each value's
    peak memory and step time as bars relative to the baseline value (log scale, 1× marked).
    ``rows``: {model, value, peak, step}, one per (model, value), ratios or None."""
    d = pd.DataFrame(rows)
    models = sorted(d["model"].unique())
    columns = min(3, len(models))
    panel_rows = -(-len(models) // columns)
    most = int(d.groupby("model")["value"].nunique().max())
    fig, axes = plt.subplots(panel_rows, columns, figsize=(3.6 * columns, panel_rows * _height(most)),
                             squeeze=False, sharex=True)
    colors = sns.color_palette("colorblind", 2)
    for ax, model in zip(axes.flat, models):
        m = d[d["model"] == model].sort_values("value")
        y = range(len(m))
        for offset, (measure, label), color in zip((-0.2, 0.2), (("peak", "peak memory"), ("step", "step time")),
                                                   colors):
            # From 1× to the ratio: left of the line is less than the baseline, right more.
            ax.barh([i + offset for i in y], m[measure] - 1, left=1.0, height=0.4, color=color, label=label)
        ax.set_yticks(list(y), list(m["value"]))
        ax.set_ylim(most - 0.5, -0.5)  # every panel's bars as thick, the first value on top
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}×"))
        ax.set_title(model, fontsize=8)
    for ax in list(axes.flat)[len(models):]:
        ax.set_visible(False)
    fig.suptitle(f"{title}: × {baseline} (log scale; 1 = the same)")
    fig.tight_layout()
    fig.legend(*axes.flat[0].get_legend_handles_labels(), fontsize=7, loc="upper right")
    _save(fig, path)


def accuracy_figure(panels: list[dict], path: Path) -> None:
    """Predicted against measured, a log-log panel per predictor, with y = x and the
    predictor's target band. ``panels``: {title, unit, scale, tolerance, points: [(measured,
    predicted, within)]}, at least one point each, all positive; values in the unit after
    dividing by ``scale``."""
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 3.4 * rows), squeeze=False)
    good, bad = sns.color_palette("colorblind")[0], sns.color_palette("colorblind")[3]
    for ax, panel in zip(axes.flat, panels):
        points = [(x / panel["scale"], y / panel["scale"], within) for x, y, within in panel["points"]]
        xs = [x for x, _, _ in points] + [y for _, y, _ in points]
        low, high = min(xs) / 1.5, max(xs) * 1.5
        line = [low, high]
        ax.plot(line, line, color="black", lw=0.8)
        band = panel["tolerance"]
        ax.fill_between(line, [v * (1 - band) for v in line], [v * (1 + band) for v in line], color="0.85",
                        label=f"±{band:.0%}")
        for within, color, label in ((True, good, "within"), (False, bad, "outside")):
            chosen = [(x, y) for x, y, w in points if w == within]
            if chosen:
                ax.scatter([x for x, _ in chosen], [y for _, y in chosen], s=10, color=color, label=label, zorder=3)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # decades only: minor labels collide on short ranges
            axis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        ax.set_xlabel(f"measured, {panel['unit']}", fontsize=8)
        ax.set_ylabel(f"predicted, {panel['unit']}", fontsize=8)
        ax.set_title(panel["title"], fontsize=8)
        ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    _save(fig, path)


def convergence_figure(curves: list[dict], path: Path) -> None:
    """Held-out loss over training as the difference from the fp32 one-process runs' mean, a
    panel per precision: those runs' band (their least and most at each evaluation) shaded
    around zero, each cell a line over it; the loss itself on a second row. ``curves``:
    {label, panel, points: [[steps done, loss], …], fp32_reference}; the references share
    their evaluation steps."""
    references = [dict(map(tuple, c["points"])) for c in curves if c["fp32_reference"]]
    steps = sorted(references[0]) if references else []
    mean = {step: sum(r[step] for r in references) / len(references) for step in steps}
    panels = list(dict.fromkeys(c["panel"] for c in curves))
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 5.6), squeeze=False, sharey="row",
                             sharex=True)
    for column, panel in enumerate(panels):
        difference, loss = axes[0][column], axes[1][column]
        if references:
            difference.fill_between(steps, [min(r[s] for r in references) - mean[s] for s in steps],
                                    [max(r[s] for r in references) - mean[s] for s in steps], color="0.8",
                                    label=f"fp32, {len(references)} seeds")
            loss.fill_between(steps, [min(r[s] for r in references) for s in steps],
                              [max(r[s] for r in references) for s in steps], color="0.8")
        for curve in curves:
            if curve["panel"] != panel or curve["fp32_reference"]:
                continue
            done, losses = zip(*curve["points"])
            line, = loss.plot(done, losses, lw=1, marker=".")
            if references:
                shared = [(s, v - mean[s]) for s, v in zip(done, losses) if s in mean]
                difference.plot(*zip(*shared), lw=1, marker=".", color=line.get_color(), label=curve["label"])
        difference.axhline(0, color="black", lw=0.6)
        difference.set_title(panel, fontsize=9)
        difference.legend(fontsize=6)
        loss.set_xlabel("steps")
    axes[0][0].set_ylabel("held-out loss − fp32 mean")
    axes[1][0].set_ylabel("held-out loss")
    fig.tight_layout()
    _save(fig, path)


def model_figures(model: str, mdf: pd.DataFrame, mrecs: list[dict], by_id: dict[str, dict], fig_dir: Path) -> dict:
    """Every chart of one model's cells: {model, figures: [{title, path}]}, paths relative to
    the report folder."""
    stem = safe_name(model)
    figures = []

    def add(title: str, name: str) -> None:
        figures.append({"title": title, "path": f"{fig_dir.name}/{name}"})

    _memory(mdf, model, fig_dir / f"memory-{stem}.svg")
    add("Peak memory per rank by category", f"memory-{stem}.svg")
    if mdf["tokens_per_s"].notna().any():
        _throughput(mdf, model, fig_dir / f"throughput-{stem}.svg")
        add("Throughput", f"throughput-{stem}.svg")
        _scatter(mdf, model, fig_dir / f"pareto-{stem}.svg")
        add("Memory vs throughput (Pareto front)", f"pareto-{stem}.svg")
    if _comm(mrecs, model, fig_dir / f"comm-{stem}.svg"):
        add("Communication per step by collective", f"comm-{stem}.svg")
    if _losses(mrecs, by_id, model, fig_dir / f"loss-{stem}.svg"):
        add("Loss curves over the reference", f"loss-{stem}.svg")
    if _step_times(mrecs, model, fig_dir / f"steptime-{stem}.svg"):
        add("Per-step time distribution", f"steptime-{stem}.svg")
    return {"model": model, "figures": figures}


def run_figure_jobs(records: list[dict], fig_dir: Path) -> list[Job]:
    """The run's per-model charts as jobs for ``render``, one per model, in model order:
    each returns its model's entry of the figures page (``model_figures``)."""
    df = ok_frame(records)
    if df.empty:
        return []
    jobs: list[Job] = []
    for model in sorted(df["model"].unique()):
        mdf = df[df["model"] == model]
        ids = set(mdf["cell_id"])
        mrecs = [r for r in records if r["cell_id"] in ids]
        # A cell's reference is the same model's single-process cell: among mrecs.
        jobs.append((model_figures, (model, mdf, mrecs, {r["cell_id"]: r for r in mrecs}, fig_dir)))
    return jobs


def render(jobs: list[Job]) -> list[Any]:
    """Run figure jobs (a module-level function and its arguments each) over the host's
    cores, returning their results in order. matplotlib draws one figure at a time per
    process, and a report is a few hundred independent figures: on two cores this halves
    the report's time. Each job writes its own files, so the bytes are the same however the
    jobs are spread."""
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers < 2:
        return [function(*args) for function, args in jobs]
    # fork: the workers start with matplotlib and the data already in memory.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = [pool.submit(function, *args) for function, args in jobs]
        return [future.result() for future in futures]


def _per_step(ax, values: list, reference_values: list, own: bool, ylabel: str) -> None:
    """A per-step series of the cell (points) over its reference's (dashed); nulls are gaps."""
    if reference_values:
        ax.plot(range(len(reference_values)), [math.nan if v is None else v for v in reference_values],
                color="black", lw=1.5, ls="--", label="reference", zorder=3)
    if values and own:
        ax.plot(range(len(values)), [math.nan if v is None else v for v in values], color="#1f77b4", marker=".",
                lw=1, label="this cell")
    ax.set_ylabel(ylabel)


def cell_loss_figure(record: dict, reference: dict | None, path: Path) -> bool:
    """One cell's training curves over its reference's: the loss per step, the gradient norm
    before clipping with the loss scale beside it (where the record has numerics), and the
    gradients' binary exponents against the compute precision's range (fp16 and bf16 cells).
    False when there is nothing to draw."""
    losses = record.get("losses") or []
    ref_losses = (reference or {}).get("losses") or []
    if not losses and not ref_losses:
        return False
    numerics = record.get("numerics") or {}
    ref_numerics = (reference or {}).get("numerics") or {}
    has_norm = any(v is not None for v in (numerics.get("grad_norm") or []) + (ref_numerics.get("grad_norm") or []))
    grad_range = numerics.get("gradient_range")
    panels = 1 + has_norm + (grad_range is not None)
    fig, axes = plt.subplots(panels, 1, figsize=(6, 2.6 * panels), squeeze=False)
    fig.subplots_adjust(left=0.14, right=0.86, bottom=0.16 / panels, top=1 - 0.05 / panels, hspace=0.45)
    own = reference is not record
    ax = axes[0][0]
    _per_step(ax, losses, ref_losses, own, "loss")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    if has_norm:
        ax = axes[1][0]
        _per_step(ax, numerics.get("grad_norm") or [], ref_numerics.get("grad_norm") or [], own,
                  "gradient norm\nbefore clipping")
        ax.set_xlabel("step")
        clip = (record.get("strategy") or {}).get("clip_grad_norm")
        if clip is not None:
            ax.axhline(clip, color="#d62728", lw=0.8, ls=":", label=f"clip_grad_norm {clip:g}")
            ax.legend(fontsize=7)
        scales = numerics.get("loss_scale") or []
        if any(s is not None for s in scales):
            twin = ax.twinx()
            twin.step(range(len(scales)), [math.nan if s is None else s for s in scales], where="mid",
                      color="#2ca02c", lw=1)
            twin.set_yscale("log", base=2)
            twin.set_ylabel("loss scale", color="#2ca02c")
            for step in numerics.get("skipped_steps") or []:
                ax.axvline(step, color="#ff7f0e", lw=0.8, alpha=0.7)
    if grad_range is not None:
        _gradient_range(axes[-1][0], grad_range)
    _save(fig, path, tight=False)
    return True


# log2 of the largest, the smallest normal and the smallest subnormal value of each compute
# precision: fp16 (5 exponent bits, 10 of mantissa) 65504 ≈ 2^16, 2^-14 and 2^-24; bf16 (8 and
# 7) ≈ 2^128, 2^-126 and 2^-133.
_RANGE_LOG2 = {"float16": (16, -14, -24), "bfloat16": (128, -126, -133)}


def _gradient_range(ax, grad_range: dict) -> None:
    """Micikevicius et al.'s histogram: the gradients' binary exponents as held (with the loss
    scale), the compute precision's smallest normal and subnormal marked."""
    bins = grad_range.get("log2_histogram") or []
    if bins:
        exponents, counts = zip(*bins)
        ax.bar(exponents, counts, width=1.0, align="edge", color="#9467bd")
        ax.set_yscale("log")
    limits = _RANGE_LOG2.get(str(grad_range.get("dtype")))
    if limits is not None:
        largest, normal, subnormal = limits
        ax.axvline(largest, color="#d62728", lw=1, ls="-.", label="largest (overflow beyond)")
        ax.axvline(normal, color="#d62728", lw=1, label="smallest normal")
        ax.axvline(subnormal, color="#d62728", lw=1, ls="--", label="smallest subnormal")
        ax.legend(fontsize=7)
    ax.set_xlabel(f"log2 |gradient| as held (loss scale {grad_range.get('loss_scale'):g}), one step")
    ax.set_ylabel("values")


def timeline_series(events: list[list]) -> pd.DataFrame:
    """A memory timeline's events ([seconds, category, signed bytes], measure/memory.py) as the
    bytes held per category after each event: one row per event, one column per category."""
    frame = pd.DataFrame(events, columns=["t", "category", "bytes"])
    # One row per event: the index itself as the key (pandas-stubs leave an Index out of ``index``).
    held = (frame.pivot_table(index=frame.index, columns="category", values="bytes", fill_value=0)  # type: ignore[arg-type]
            .reindex(columns=list(MEM_CATEGORIES), fill_value=0).cumsum())
    held.insert(0, "t", frame["t"])
    return held


def memory_timeline_figure(timeline: dict, path: Path) -> bool:
    """One rank's memory over the memory-tracked step, stacked by category; False when the
    timeline has no events."""
    events = timeline.get("events") or []
    if not events:
        return False
    held = timeline_series(events)
    fig, ax = plt.subplots(figsize=(7, 3))
    fig.subplots_adjust(left=0.1, right=0.78, bottom=0.16, top=0.92)
    colors = sns.color_palette("colorblind", len(MEM_CATEGORIES))
    ax.stackplot(held["t"] * 1e3, *[held[c] / MIB for c in MEM_CATEGORIES], labels=MEM_CATEGORIES,
                 colors=colors, step="post")
    ax.set_xlabel("ms into the memory-tracked step")
    ax.set_ylabel("MiB held")
    ax.set_title(f"rank {timeline.get('rank')}: memory over the step ({timeline.get('tracker')})"
                 + (", truncated" if timeline.get("truncated") else ""), fontsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    _save(fig, path, tight=False)
    return True


def history(cell_id: str, points: list[tuple[str, dict]], path: Path) -> str:
    """One cell's peak memory and step time over runs (``points``: run id, metrics; oldest first)."""
    labels = [run_id for run_id, _ in points]
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(8, 2.2))
    mem_ax.plot(labels, [m["peak_mem_bytes"] / MIB for _, m in points], marker="o")
    mem_ax.set_ylabel("peak MiB / rank")
    time_ax.errorbar(labels, [m["step_time_s"] * 1e3 for _, m in points],
                     yerr=[(m.get("step_time_iqr_s") or 0.0) * 1e3 / 2 for _, m in points],
                     marker="o", capsize=3)
    time_ax.set_ylabel("step ms (± IQR/2)")
    for ax in (mem_ax, time_ax):
        ax.set_ylim(bottom=0)
        ax.tick_params(axis="x", labelrotation=30, labelsize=6)
    fig.suptitle(cell_id, fontsize=8)
    return _save(fig, path)
