"""reports/index.html: every run in results/, each flagged when ``compare`` marks cells of it
worse than the run before it on the same suite and hardware, and each cell's history across
runs (as asv shows a benchmark over commits), built from results/ alone; and ``publish``, a
copy of reports/ ready for static hosting."""

from __future__ import annotations

import shutil
from pathlib import Path

from harness.report import compare, compare_stats, figures
from harness.report.html import ENV, cell_page_name
from harness.results import trials
from harness.results.store import load_records, load_run_info


def _runs(results_dir: Path) -> list[dict]:
    """Every run folder (not the ``latest`` link), oldest first: run ids start with a timestamp."""
    runs = []
    for path in sorted(p for p in results_dir.iterdir() if p.is_dir() and not p.is_symlink()):
        info = load_run_info(path)
        env = info.get("environment") or {}
        git = env.get("git") or {}
        every_trial = load_records(path)
        records = trials.aggregate(every_trial)  # a cell's trials: their medians
        runs.append({
            "every_trial": every_trial,
            "run_id": path.name,
            "suite": info.get("suite") or "?",
            "commit": (git.get("commit") or "")[:10],
            "dirty": git.get("dirty"),
            "hardware": (info.get("device") or {}).get("name") or (env.get("hardware") or {}).get("cpu") or "?",
            "world_size": info.get("world_size") or "?",
            "ok": sum(r["status"] == "ok" for r in records),
            "total": len(records),
            "records": {r["cell_id"]: r for r in records},
        })
    return runs


def _measured(record: dict | None) -> bool:
    """ok, with the two numbers a history shows (a record from a broken writer may lack them)."""
    if not record:
        return False
    metrics = record.get("metrics") or {}
    return (record["status"] == "ok"
            and metrics.get("peak_mem_bytes") is not None and metrics.get("step_time_s") is not None)


def _comparable(a: dict, b: dict) -> bool:
    """Two runs whose cells ``compare`` can set side by side: the same suite, world size and
    hardware (another machine's step times say nothing about a change)."""
    return all(a[k] == b[k] for k in ("suite", "world_size", "hardware"))


def _flag_worse(runs: list[dict], reports_dir: Path) -> None:
    """Each run against the run before it that is comparable: how many cells ``compare``
    marks worse (a slower step or more memory beyond noise, or ok → not ok), with the
    comparison page written beside the index (compare-<before>-<run>.html)."""
    for i, run in enumerate(runs):
        before = next((b for b in reversed(runs[:i]) if _comparable(b, run)), None)
        run["against"] = None
        if before is None:
            continue
        comparisons = compare_stats.compare_record_lists(before["every_trial"], run["every_trial"])
        page = compare.write_html(reports_dir / f"compare-{before['run_id']}-{run['run_id']}.html", comparisons,
                                  before["run_id"], run["run_id"])
        run["against"] = {"run_id": before["run_id"], "page": page.name,
                          "worse": sum(c.verdict == compare_stats.WORSE for c in comparisons)}


def write_index(results_dir: Path, reports_dir: Path) -> Path:
    """reports/index.html over every run in ``results_dir``; a cell measured ok in two or
    more runs gets a history chart of its peak memory and step time."""
    runs = _runs(results_dir) if results_dir.is_dir() else []
    history_dir = reports_dir / "history"
    history_dir.mkdir(parents=True, exist_ok=True)
    cell_ids = sorted({cell_id for run in runs for cell_id in run["records"]})
    histories = []
    for cell_id in cell_ids:
        measured = [run for run in runs if _measured(run["records"].get(cell_id))]
        if len(measured) < 2:
            continue
        figure = history_dir / f"{Path(cell_page_name(cell_id)).stem}.svg"
        figures.history(cell_id, [(run["run_id"], run["records"][cell_id]["metrics"]) for run in measured], figure)
        histories.append({"cell_id": cell_id, "figure": figure.relative_to(reports_dir).as_posix(),
                          "runs": len(measured)})
    _flag_worse(runs, reports_dir)
    for run in runs:
        run["report"] = f"{run['run_id']}/index.html" if (reports_dir / run["run_id"] / "index.html").exists() else None
    page = reports_dir / "index.html"
    page.write_text(ENV.get_template("index.html.j2").render(runs=list(reversed(runs)), histories=histories))
    return page


def publish(reports_dir: Path, destination: Path) -> Path:
    """Copy reports/ (every run's report, the index, comparison pages) to ``destination``.
    Every link inside is relative, so the folder works from any static host or file://."""
    if not (reports_dir / "index.html").exists():
        raise ValueError(f"no reports at {reports_dir}: run a suite or `harness report` first")
    if destination.resolve().is_relative_to(reports_dir.resolve()):
        raise ValueError(f"{destination} is inside {reports_dir}: publish somewhere else")
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise ValueError(f"{destination} exists and is not an empty folder: publish into a new one")
    shutil.copytree(reports_dir, destination, dirs_exist_ok=True)
    return destination / "index.html"
