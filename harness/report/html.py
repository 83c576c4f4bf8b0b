"""A run's static HTML report, built from results/ alone (the report is a pure function of
the results): reports/<run_id>/index.html (the findings first (report/findings.py), the
selection guide (report/guide.py), predicted beside measured, the claims table when the run
has claims.jsonl, the summary table, engines table, environment),
figures.html (every cell's charts, model by model), cells/<cell>.html (one page per cell) and
figures/*.svg. Self-contained: inline
CSS and JS, no network; every string from the results is escaped (jinja2 autoescape)."""

from __future__ import annotations

import hashlib
import json
import shlex
import tomllib
from pathlib import Path

import jinja2

from harness.predict import accuracy
from harness.report import figures, findings, guide, real_data
from harness.results import trials
from harness.results.store import load_records, load_run_info

ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("harness.report", "templates"),
    autoescape=True,  # every string from results is escaped
    undefined=jinja2.StrictUndefined,
)

# A strategy's engine (the library that implements it), for the filter and engines table.
_ENGINES = {
    "deepspeed": "DeepSpeed",
    "fairscale": "FairScale",
}


def engine_of(strategy: str) -> str:
    if strategy == "single":
        return "reference"
    for prefix, engine in _ENGINES.items():
        if strategy.startswith(prefix):
            return engine
    return "PyTorch"


def _mib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "" if value is None else f"{value * scale:.{digits}f}"


def _num(value) -> str:
    """A sort key for a numeric cell (empty sorts last)."""
    return "" if value is None else repr(float(value))


def cell_page_name(cell_id: str) -> str:
    # A short hash keeps two ids that differ only in unsafe characters apart.
    digest = hashlib.sha1(cell_id.encode()).hexdigest()[:8]
    return f"{figures.safe_name(cell_id)}-{digest}.html"


ENV.filters.update(mib=_mib, fmt=_fmt, cell_page=cell_page_name)


def _verdict(record: dict) -> tuple[str, str]:
    """(text, css class) of the equivalence gate."""
    eq = record.get("equivalence")
    if eq is None:
        return ("reference" if record.get("status") == "ok" else "", "")
    if eq.get("passed") is None:
        return "not gated", ""  # its reference does not fit (harness/equivalence.py)
    text = "yes" if eq.get("passed") else "NO"
    if eq.get("max_rel_loss_diff") is not None:
        text += f" ({eq['max_rel_loss_diff']:.1e}"
        if eq.get("tolerance") is not None:
            text += f", tol {eq['tolerance']:.0e}"
        text += ")"
    return text, "" if eq.get("passed") else "bad"


def _trials_cell(r: dict) -> tuple[str, str]:
    """(display, sort key) of the run table's trials column (a run with --repeat): how many
    trials, their step-time spread, and whether peak memory moved across them."""
    t = r.get("trials") or {}
    if t.get("spread") is None:
        return str(t.get("n", "")), ""
    moved = t["peak_mem_range_bytes"]
    return (f"{t['n']} · {t['spread'] * 100:.1f}% · {'same' if moved == 0 else _mib(moved) + ' MiB'}",
            _num(t["spread"]))


def _growth_note(growth: int | None) -> str:
    """A leak, beside the peak: held memory grew over the timed steps (measure/summary.py)."""
    return f" (leak: +{growth:,} B)" if growth is not None and growth > 0 else ""


def _row(r: dict) -> dict:
    m = r.get("metrics") or {}
    strategy = (r.get("strategy") or {}).get("name") or "?"
    verdict, verdict_class = _verdict(r)
    reason = r.get("reason") or ""
    mfu = m.get("mfu")
    return {
        "cell_id": r["cell_id"],
        "page": f"cells/{cell_page_name(r['cell_id'])}",
        "status": r.get("status", "?"),
        "model": (r.get("model") or {}).get("name") or "?",
        "strategy": strategy,
        "engine": engine_of(strategy),
        "precision": r.get("precision") or (r.get("strategy") or {}).get("precision") or "",
        "world_size": r.get("world_size"),
        "zero_idea": r.get("zero_idea"),
        "cols": [  # (display, sort key)
            (_mib(m.get("peak_mem_bytes")) + _growth_note(m.get("memory_growth_bytes")), _num(m.get("peak_mem_bytes"))),
            (_fmt(m.get("step_time_s"), 1000, 2) + (f" ± {_fmt(m.get('step_time_iqr_s'), 1000, 2)}"
                                                    if m.get("step_time_iqr_s") is not None else ""),
             _num(m.get("step_time_s"))),
            (_fmt(m.get("tokens_per_s"), 1, 0), _num(m.get("tokens_per_s"))),
            (_fmt(m.get("tflops_per_rank"), 1, 4), _num(m.get("tflops_per_rank"))),
            ("" if mfu is None else f"{mfu * 100:.1f}%" + (" (suspect)" if m.get("mfu_suspect") else ""),
             _num(mfu)),
            (_mib(m.get("comm_bytes_per_step")), _num(m.get("comm_bytes_per_step"))),
            (_fmt(m.get("comm_time_s_per_step"), 1000, 2), _num(m.get("comm_time_s_per_step"))),
            (_fmt(m.get("comm_exposed_s_per_step"), 1000, 2), _num(m.get("comm_exposed_s_per_step"))),
        ],
        "trials": _trials_cell(r),
        "verdict": verdict,
        "verdict_class": verdict_class,
        "reason_line": reason.strip().splitlines()[-1] if reason.strip() else "",
        "reason": reason,
    }


def _engine_groups(rows: list[dict]) -> list[dict]:
    """Cells implementing the same ZeRO stage, same model, precision and world size, side by
    side across engines."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["zero_idea"]:
            key = (row["zero_idea"], row["model"], row["precision"], row["world_size"])
            groups.setdefault(key, []).append(row)
    out = []
    for (idea, model, precision, ws), members in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        members.sort(key=lambda r: (r["engine"], r["strategy"], r["cell_id"]))
        out.append({"zero_idea": idea, "model": model, "precision": precision, "world_size": ws,
                    "engines": sorted({m["engine"] for m in members}), "rows": members})
    return out


_CLAIM_VERDICT_CLASS = {"holds": "good", "does not hold": "bad", "not measurable here": "na"}


def _claim_rows(run_dir: Path) -> list[dict]:
    """The run's claim records (results/<run_id>/claims.jsonl), ready for the claims table."""
    from harness.claims import records as claim_records

    rows = []
    for r in claim_records.load_records(run_dir):
        unit = r.get("unit") or ""
        ratio = r.get("ratio")
        rows.append({
            "claim_id": r.get("claim_id", "?"), "title": r.get("title") or "", "source": r.get("source") or "",
            "published": r.get("published") or "", "formula": r.get("formula") or "",
            "predicted": claim_records.format_value(r.get("predicted"), unit),
            "measured": claim_records.format_value(r.get("measured"), unit),
            "unit": unit, "ratio": "" if ratio is None else f"{ratio:.3f}",
            "tolerance": r.get("tolerance") or "", "verdict": r.get("verdict") or "?",
            "verdict_class": _CLAIM_VERDICT_CLASS.get(r.get("verdict") or "", ""),
            "explained": bool(r.get("explained")), "reason": r.get("reason") or "",
        })
    return rows


def _claim_selecting(cell_id: str, world_size: int | None) -> str | None:
    """In a claims run, the claim that reads this cell (or the cell it is the reference of)
    with the fewest cells: rerunning it reruns the cell."""
    from harness.claims import catalogue

    if not world_size:
        return None
    best = None
    for claim in catalogue.CLAIMS.values():
        read = claim.cells(world_size)
        if any(cell_id in (c.cell_id, c.reference().cell_id) for c in read) and (best is None or len(read) < best[0]):
            best = (len(read), claim.claim_id)
    return best and best[1]


def reproduce_command(record: dict, info: dict) -> str:
    """The command that runs exactly this cell again. pytest -k accepts '/' and '[' ']' in
    its identifiers, and the full test name ``test_cell[<id>]`` matches no other cell. A
    claims run has one test per claim: the command reruns a claim that reads the cell."""
    from harness import suites

    args = ["./run_all.sh"]
    suite = info.get("suite")
    if suite:
        args += ["--suite", str(suite)]
    ws = info.get("world_size") or record.get("world_size")
    if ws:
        args += ["--gpus", str(ws)]
    device = (info.get("device") or {}).get("type")
    if device:
        args += ["--device", str(device)]
    if (info.get("repeat") or 1) > 1:
        args += ["--repeat", str(info["repeat"])]
    if info.get("mem_cap_bytes"):
        args += ["--mem-cap-gib", f"{info['mem_cap_bytes'] / 2**30:g}"]
    claim = (_claim_selecting(record["cell_id"], ws) if suite in suites.CLAIMS_SUITES else None)
    args += ["-k", f"test_claim[{claim}]" if claim else f"test_cell[{record['cell_id']}]"]
    return shlex.join(args)


def _suite_description(info: dict) -> str | None:
    """A suite file's own ``description`` (run.json keeps the file's text)."""
    try:
        description = tomllib.loads(info.get("suite_file") or "").get("description")
    except tomllib.TOMLDecodeError:
        return None
    return description if isinstance(description, str) else None


def _environment(info: dict) -> dict:
    env = info.get("environment") or {}
    hardware = env.get("hardware") or {}
    git = env.get("git") or {}
    return {
        "hardware": {k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in hardware.items()},
        "python": env.get("python"),
        "platform": env.get("platform"),
        "versions": env.get("versions") or {},
        "git_commit": git.get("commit"),
        "git_dirty": git.get("dirty"),
        "env": env.get("env") or {},
        "bandwidth": env.get("bandwidth"),
        "bandwidth_across_nodes": env.get("bandwidth_across_nodes"),  # runs on several nodes
        "interconnect": env.get("interconnect"),  # null in runs from before it was recorded
    }


def _memory_timeline_svg(record: dict, run_dir: Path, fig_dir: Path, page_stem: str) -> str | None:
    """The cell's memory-over-time chart from its peak rank's timeline JSON (run with
    --memory-snapshot); None when there is none. The CUDA pickle beside it is never read."""
    ranks = [p for p in record.get("per_rank") or [] if p.get("memory_timeline")]
    if not ranks:
        return None
    peak_rank = max(ranks, key=lambda p: p.get("peak_mem_bytes") or 0)
    try:
        timeline = json.loads((run_dir / peak_rank["memory_timeline"]).read_text())
    except (OSError, ValueError):
        return None
    name = f"memory-{page_stem}.svg"
    return f"../figures/cells/{name}" if figures.memory_timeline_figure(timeline, fig_dir / "cells" / name) else None


def _ratio_cell(effect: findings.Effect) -> dict:
    """A findings table entry: the measured effect, its spread over the pairs, the predicted."""
    spread = ("" if effect.low is None or effect.high is None or effect.low == effect.high
              else f"{effect.low:.2f}–{effect.high:.2f}")
    return {"measured": _fmt(effect.measured, 1, 2), "spread": spread, "predicted": _fmt(effect.predicted, 1, 2)}


def _findings(records: list[dict], fig_dir: Path, jobs: list[figures.Job]) -> list[dict]:
    """The findings section: per axis one row per value (findings.py) and its figure (a job
    added to ``jobs``)."""
    sections = []
    for axis, found in findings.run_findings(records):
        name = f"findings-{axis.key}.svg"
        jobs.append((figures.axis_figure, (axis.title, found[0].baseline, findings.per_model(found), fig_dir / name)))
        sections.append({
            "key": axis.key, "title": axis.title, "baseline": found[0].baseline,
            "figure": f"{fig_dir.name}/{name}",
            "rows": [{
                "value": f.value, "n": len(f.pairs), "sentence": f.sentence,
                "effects": {m: _ratio_cell(f.effects[m]) for m in findings.MEASURES},
                "disagree": any(e.disagree for e in f.effects.values()),
                "pairs": [{"cell_id": p.cell_id, "page": f"cells/{cell_page_name(p.cell_id)}",
                           "baseline_id": p.baseline_id, "baseline_page": f"cells/{cell_page_name(p.baseline_id)}"}
                          for p in f.pairs],
            } for f in found],
        })
    return sections


# Each predictor's unit in the accuracy figure: (unit, divisor).
_ACCURACY_UNITS = {"step_time": ("ms", 1e-3)}


def _accuracy(records: list[dict], fig_dir: Path, jobs: list[figures.Job]) -> dict | None:
    """Predicted beside measured (harness/predict/accuracy.py): per predictor its target,
    how many cells met it, the median and worst ratio, and a log-log figure of them all (a
    job added to ``jobs``)."""
    targets = [s for s in accuracy.summary(accuracy.measured_cells(records)) if s["compared"]]
    if not targets:
        return None
    panels = []
    for s in targets:
        unit, scale = _ACCURACY_UNITS.get(s["target"], ("MiB", 2**20))
        points = []
        for r, c in s["compared"]:
            measured = accuracy.measured_value(s["target"], r["metrics"])
            if measured and c["ratio"] > 0:  # a log-log figure: nothing at zero
                points.append((measured, c["ratio"] * measured, c["within_target"]))
        if points:
            panels.append({"title": s["target"], "unit": unit, "scale": scale, "tolerance": s["tolerance"],
                           "points": points})
    if panels:
        jobs.append((figures.accuracy_figure, (panels, fig_dir / "accuracy.svg")))
    return {"figure": f"{fig_dir.name}/accuracy.svg" if panels else None, "rows": [{
        "target": s["target"], "tolerance": f"±{s['tolerance']:.0%}", "n": len(s["compared"]),
        "within": len(s["compared"]) - len(s["missed"]), "median": f"{s['median']:.3f}",
        "worst": f"{s['worst'][1]['ratio']:.3f}", "worst_cell": s["worst"][0]["cell_id"],
        "worst_page": f"cells/{cell_page_name(s['worst'][0]['cell_id'])}",
        "off": s["worst"][1]["off"] or "", "met": s["met"],
    } for s in targets]}


def _loss_figure_name(row: dict) -> str:
    return f"loss-{Path(row['page']).stem}.svg"


def write_run_report(run_dir: Path, report_dir: Path, skipped: list[str] | None = None) -> Path:
    """The run's pages. What cannot be read is skipped with a warning, counted on the page,
    and appended to ``skipped`` when given."""
    skipped = [] if skipped is None else skipped
    records = trials.aggregate(load_records(run_dir, skipped))
    info = load_run_info(run_dir, skipped)
    report_dir.mkdir(parents=True, exist_ok=True)
    fig_dir = report_dir / "figures"
    fig_dir.mkdir(exist_ok=True)
    cells_dir = report_dir / "cells"
    cells_dir.mkdir(exist_ok=True)

    rows = [_row(r) for r in records]
    by_id = {r["cell_id"]: r for r in records}
    run_id = info.get("run_id") or run_dir.name
    environment = _environment(info)
    statuses = sorted({r["status"] for r in rows})
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in statuses}

    # Every figure is a job, drawn together over the host's cores (figures.render).
    model_jobs = figures.run_figure_jobs(records, fig_dir)
    jobs: list[figures.Job] = []
    findings_sections = _findings(records, fig_dir, jobs)
    accuracy_section = _accuracy(records, fig_dir, jobs)
    convergence_section = real_data.section(records, fig_dir, jobs, lambda cell_id: f"cells/{cell_page_name(cell_id)}")
    refs, loss_jobs = [], {}  # loss_jobs: figure name -> its job, for the ok cells
    for record, row in zip(records, rows):
        eq = record.get("equivalence") or {}
        ref = by_id.get(eq.get("reference_cell_id")) if eq.get("reference_cell_id") else None
        if ref is None and record.get("equivalence") is None and record.get("status") == "ok":
            ref = record  # a reference: its own curve
        refs.append(ref)
        if record.get("status") == "ok":
            loss_jobs[_loss_figure_name(row)] = (figures.cell_loss_figure,
                                                 (record, ref, fig_dir / "cells" / _loss_figure_name(row)))
    drawn = figures.render(model_jobs + jobs + list(loss_jobs.values()))
    figure_groups = drawn[:len(model_jobs)]
    losses_drawn = dict(zip(loss_jobs, drawn[len(model_jobs) + len(jobs):]))  # name -> whether drawn

    cell_template = ENV.get_template("cell.html.j2")
    for record, row, ref in zip(records, rows, refs):
        name = _loss_figure_name(row)
        loss_svg = f"../figures/cells/{name}" if losses_drawn.get(name) else None
        (report_dir / row["page"]).write_text(cell_template.render(
            run_id=run_id, r=record, row=row, ref=ref if ref is not record else None,
            ref_page=(f"{cell_page_name(ref['cell_id'])}" if ref is not None and ref is not record else None),
            loss_svg=loss_svg, command=reproduce_command(record, info),
            memory_svg=_memory_timeline_svg(record, run_dir, fig_dir, Path(row["page"]).stem),
            cell_json=json.dumps(record.get("cell") or {}, indent=2, sort_keys=True),
            engine_json=[(p.get("rank"), json.dumps(p.get("engine"), indent=2, sort_keys=True))
                         for p in record.get("per_rank") or [] if p.get("engine")],
            env=environment, analytic_activations=_analytic_activations(record),
            numerics_rows=numerics_rows(record), profile=_profile(record, info, run_id),
            modules=module_memory_rows(record)))

    claim_rows = _claim_rows(run_dir)
    claim_counts = {v: sum(1 for c in claim_rows if c["verdict"] == v) for v in _CLAIM_VERDICT_CLASS}

    if figure_groups:
        (report_dir / "figures.html").write_text(ENV.get_template("figures.html.j2").render(
            run_id=run_id, figure_groups=figure_groups))
    page = report_dir / "index.html"
    page.write_text(ENV.get_template("run.html.j2").render(
        claims=claim_rows, claim_counts=claim_counts, findings=findings_sections,
        accuracy=accuracy_section, convergence=convergence_section, guide=guide.selection_guide(records),
        suite_description=_suite_description(info),
        info=info, run_id=run_id, rows=rows, skipped=skipped, counts=counts, statuses=statuses,
        models=sorted({r["model"] for r in rows}), engines=sorted({r["engine"] for r in rows}),
        figure_groups=figure_groups, engine_groups=_engine_groups(rows), env=environment,
        max_trials=max((r["trials"]["n"] for r in records), default=1),
        device=info.get("device") or {}))
    return page


def module_memory_rows(record: dict) -> dict:
    """The cell page's per-module memory (measure/memory.py, "Per module"), from the rank with
    the peak: each module's peaks, the backward peak by category and its bar's segments (% of
    the largest backward peak of the table)."""
    ranks = [p for p in record.get("per_rank") or [] if p.get("module_memory")]
    if not ranks:
        return {"rows": []}
    peak_rank = max(ranks, key=lambda p: p.get("peak_mem_bytes") or 0)
    rows = []
    for entry in peak_rank["module_memory"]:
        forward, backward = entry.get("peak_forward_bytes") or {}, entry.get("peak_backward_bytes") or {}
        rows.append({"module": entry["module"], "params_bytes": entry.get("params_bytes"),
                     "forward": sum(forward.values()) if forward else None,
                     "backward": sum(backward.values()) if backward else None, "backward_by": backward})
    widest = max((row["backward"] or 0 for row in rows), default=0) or 1
    for row in rows:
        row["widths"] = {cat: round(100 * row["backward_by"].get(cat, 0) / widest, 1) for cat in figures.MEM_CATEGORIES}
    return {"rank": peak_rank.get("rank"), "categories": figures.MEM_CATEGORIES, "rows": rows}


def _profile(record: dict, info: dict, run_id: str) -> dict:
    """The cell page's profile section: each rank's trace of the timed steps (--profile),
    linked from the report to the results folder beside it, and on CUDA the Nsight Systems
    command for the same cell (measure/profiling.py)."""
    traces = [(p.get("rank"), f"../../../results/{run_id}/{p['profile_trace']}")
              for p in record.get("per_rank") or [] if p.get("profile_trace")]
    on_cuda = (info.get("device") or {}).get("type") == "cuda"
    output = "nsys-" + "".join(c if c.isalnum() else "_" for c in record["cell_id"]).strip("_")
    return {"traces": traces,
            "nsys": (f"nsys profile -o {output} --trace=cuda,nvtx,osrt --cuda-memory-usage=true "
                     + reproduce_command(record, info)) if on_cuda else None}


def numerics_rows(record: dict) -> list[tuple[str, str]]:
    """The cell page's numerics table (measure/numerics.py): label and text per row; none for
    a record without numerics (a cell that did not train, or one recorded before them)."""
    n = record.get("numerics")
    if not n:
        return []
    scales = [s for s in n["loss_scale"] if s is not None]
    measured = [(step, norm) for step, norm in enumerate(n["grad_norm"]) if norm is not None]
    clip = (record.get("strategy") or {}).get("clip_grad_norm")
    skipped = n["skipped_steps"]
    skipped_text = f"{len(skipped)}" + (f" (steps {', '.join(map(str, skipped))})" if skipped else "")
    norm_text = (f"{measured[0][1]:.4g} at step {measured[0][0]}, {measured[-1][1]:.4g} at step {measured[-1][0]}"
                 f" ({len(measured)} of {len(n['grad_norm'])} steps measured)" if measured else "not measured")
    g = n.get("gradient_range")
    range_text = (f"{100 * g['fraction_zero_or_subnormal']:.3g} % as held (loss scale {g['loss_scale']:g}),"
                  f" {100 * g['fraction_zero_or_subnormal_unscaled']:.3g} % without the scale; {g['zero_in_fp32']:,}"
                  f" of {g['values']:,} values zero already in fp32 ({g['dtype']}, summed over the ranks)"
                  if g else n["gradient_range_reason"])
    return [
        ("loss scale", f"{min(scales):g} to {max(scales):g}" if scales else "none (no loss scaling)"),
        ("steps skipped for overflow", skipped_text),
        ("gradient norm before clipping", norm_text + (f"; clipped to {clip:g}" if clip is not None else "")),
        ("gradients zero or subnormal in the compute precision", range_text),
    ]


def _analytic_activations(record: dict) -> float | None:
    analytic = (record.get("predicted") or {}).get("analytic") or {}
    return accuracy.start_of_backward_activations(analytic) if "activation_bytes" in analytic else None
