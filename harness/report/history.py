"""reports/index.html: every run in results/, and each cell's history across runs (as asv
shows a benchmark over commits), built from results/ alone; and ``publish``, a copy of
reports/ ready for static hosting."""

from __future__ import annotations

import shutil
from pathlib import Path

from harness.report import figures
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
        records = trials.aggregate(load_records(path))  # a cell's trials: their medians
        runs.append({
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
