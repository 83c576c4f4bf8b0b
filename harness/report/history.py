"""reports/index.html: every run in results/, and each cell's history across runs (as asv
shows a benchmark over commits), built from results/ alone; and ``publish``, a copy of
reports/ ready for static hosting."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt  # noqa: E402

from harness.report.html import ENV, cell_page_name  # noqa: E402
from harness.results.store import load_records  # noqa: E402

MIB = 2**20


def _runs(results_dir: Path) -> list[dict]:
    """Every run folder (not the ``latest`` link), oldest first: run ids start with a timestamp."""
    runs = []
    for path in sorted(p for p in results_dir.iterdir() if p.is_dir() and not p.is_symlink()):
        info_path = path / "run.json"
        try:
            info = json.loads(info_path.read_text()) if info_path.exists() else {}
        except json.JSONDecodeError:
            info = {}
        records = load_records(path)
        env = info.get("environment", {})
        runs.append({
            "run_id": path.name,
            "suite": info.get("suite", "?"),
            "commit": (env.get("git", {}).get("commit") or "")[:10],
            "dirty": env.get("git", {}).get("dirty"),
            "hardware": info.get("device", {}).get("name") or env.get("hardware", {}).get("cpu", "?"),
            "world_size": info.get("world_size", "?"),
            "ok": sum(r["status"] == "ok" for r in records),
            "total": len(records),
            "records": {r["cell_id"]: r for r in records},
        })
    return runs


def _measured(record: dict | None) -> bool:
    """ok and with the metrics a history shows (an ok record from a broken writer may lack them)."""
    return bool(record) and record["status"] == "ok" and {"peak_mem_bytes", "step_time_s"} <= record["metrics"].keys()


def _history_figure(cell_id: str, runs: list[dict], path: Path) -> None:
    points = [(run["run_id"], run["records"][cell_id]["metrics"]) for run in runs]
    labels = [run_id for run_id, _ in points]
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(8, 2.2))
    mem_ax.plot(labels, [m["peak_mem_bytes"] / MIB for _, m in points], marker="o")
    mem_ax.set_ylabel("peak MiB / rank")
    time_ax.errorbar(labels, [m["step_time_s"] * 1e3 for _, m in points],
                     yerr=[m.get("step_time_iqr_s", 0.0) * 1e3 / 2 for _, m in points], marker="o", capsize=3)
    time_ax.set_ylabel("step ms (± IQR/2)")
    for ax in (mem_ax, time_ax):
        ax.set_ylim(bottom=0)
        ax.tick_params(axis="x", labelrotation=30, labelsize=6)
    fig.suptitle(cell_id, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="svg")
    plt.close(fig)


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
        _history_figure(cell_id, measured, figure)
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
    if destination.exists() and any(destination.iterdir()):
        raise ValueError(f"{destination} exists and is not empty: publish into a new folder")
    shutil.copytree(reports_dir, destination, dirs_exist_ok=True)
    return destination / "index.html"
