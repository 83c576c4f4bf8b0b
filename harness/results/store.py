"""results/<run_id>/: run.json (environment, command), cells.jsonl (one record per cell,
appended and fsynced as each cell ends) and results/latest pointing at the newest run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from harness.results.schema import migrate


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


class RunStore:
    def __init__(self, results_dir: Path, run_id: str):
        self.run_id = run_id
        self.path = results_dir / run_id
        self.path.mkdir(parents=True, exist_ok=True)
        self.cells_path = self.path / "cells.jsonl"
        self._point_latest(results_dir)

    def _point_latest(self, results_dir: Path) -> None:
        # Replace the link atomically: a reader never sees "latest" missing.
        tmp = results_dir / f".latest-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.run_id)
        tmp.replace(results_dir / "latest")

    def write_run_info(self, info: dict) -> None:
        tmp = self.path / "run.json.tmp"
        tmp.write_text(json.dumps(info, indent=2, sort_keys=True))
        tmp.replace(self.path / "run.json")

    def append(self, record: dict) -> None:
        """One line per record in a single write, flushed and fsynced: a killed run keeps
        every cell that finished, and at worst loses a truncated last line."""
        line = json.dumps(record) + "\n"
        with self.cells_path.open("a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def load_run_info(run_dir: Path) -> dict:
    """run.json as a dict; {} when it is missing or unreadable (a killed run, an old layout)."""
    try:
        info = json.loads((run_dir / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return info if isinstance(info, dict) else {}


def load_records(run_dir: Path) -> list[dict]:
    """Every complete record of a run; a truncated last line (a killed writer) is skipped."""
    records = []
    path = run_dir / "cells.jsonl"
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(migrate(json.loads(line)))
        except json.JSONDecodeError:
            continue
    return records


def resolve_run(results_dir: Path, run: str) -> Path:
    path = Path(run)
    if not path.is_dir():
        path = results_dir / run
    if not (path / "cells.jsonl").exists() and not (path / "run.json").exists():
        raise ValueError(f"no run at {path}: give a run id under {results_dir} or a run folder")
    return path.resolve()
