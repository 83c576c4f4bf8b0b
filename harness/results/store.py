"""results/<run_id>/: run.json (environment, command, resume events), cells.jsonl (one
record per cell and trial, appended and fsynced as each cell ends; a resumed run appends to it) and
results/latest pointing at the newest run. A claims run's claims.jsonl (harness/claims/) is
appended the same way, by append_json_line.

Reading never fails on damage: what cannot be read is skipped with a DamagedResultsWarning
that names the file and line (README "Resuming and damaged results")."""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harness.results.schema import Record, UnreadableRecord, migrate


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


class ResultsNotWritable(Exception):
    """A results file could not be written (disk full, read-only, the folder gone): what was
    written before is intact, and a record cut by the failure has been removed."""

    def __init__(self, path: Path, error: OSError):
        super().__init__(f"cannot write {path}: {error.strerror or error} (errno {error.errno}); free space or"
                         " restore the folder; the records written before are intact")
        self.path = path


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """An OSError while writing ``path`` as ResultsNotWritable, naming it."""
    try:
        yield
    except OSError as error:
        raise ResultsNotWritable(path, error) from error


class RunStore:
    def __init__(self, results_dir: Path, run_id: str):
        self.run_id = run_id
        self.path = results_dir / run_id
        self._appended = False
        with _writing(self.path):
            self.path.mkdir(parents=True, exist_ok=True)
            self.cells_path = self.path / "cells.jsonl"
            self._point_latest(results_dir)

    def _point_latest(self, results_dir: Path) -> None:
        # Replace the link atomically: a reader never sees "latest" missing.
        tmp = results_dir / f".latest-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.run_id)
        tmp.replace(results_dir / "latest")

    def write_run_info(self, info: dict[str, Any]) -> None:
        tmp = self.path / "run.json.tmp"
        with _writing(self.path / "run.json"):
            try:
                tmp.write_text(json.dumps(info, indent=2, sort_keys=True))
                tmp.replace(self.path / "run.json")
            finally:
                tmp.unlink(missing_ok=True)  # a half-written copy (the run.json before it stays whole)

    def append(self, record: Record) -> None:
        """One cell record, appended to cells.jsonl by append_json_line. After the first, the
        file must be there: a run folder removed under a run is an error, not a fresh file."""
        append_json_line(self.cells_path, record, create=not self._appended)
        self._appended = True


def append_json_line(path: Path, record: Record, *, default: Callable[[Any], Any] | None = None,
                     create: bool = True) -> None:
    """One line per record in a single write, flushed and fsynced: a killed run keeps every
    record that finished, and at worst loses a truncated last line. ``default`` is json.dumps's
    (what to write for a value JSON has no type for); ``create``: make the file if it is not
    there. A failed write is cut away and raised as ResultsNotWritable."""
    line = json.dumps(record, default=default) + "\n"
    if _ends_mid_line(path):
        line = "\n" + line  # a killed writer's cut line stays alone, skipped by the loader
    data = line.encode()
    with _writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0), 0o644)
        try:
            before = os.fstat(fd).st_size
            try:
                written = 0
                while written < len(data):  # unbuffered: nothing is left to write later, on close
                    written += os.write(fd, data[written:])
                os.fsync(fd)
            except OSError:
                # Disk full or the like mid-record: cut what was written, so the file holds whole
                # records only (truncating frees space; where even that fails, the loader skips it).
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, before)
                raise
        finally:
            os.close(fd)


def _ends_mid_line(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


class DamagedResultsWarning(UserWarning):
    """Part of a results folder could not be read and was skipped (the message names the
    file and line)."""


def _skip(message: str, skipped: list[str] | None) -> None:
    warnings.warn(message, DamagedResultsWarning, stacklevel=3)
    if skipped is not None:
        skipped.append(message)


def load_run_info(run_dir: Path, skipped: list[str] | None = None) -> dict[str, Any]:
    """run.json as a dict; {} when it is missing or unreadable (a killed run, an old layout),
    with a DamagedResultsWarning (appended to ``skipped`` when given)."""
    path = run_dir / "run.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        _skip(f"{path}: missing; the run's suite, command and environment are unknown", skipped)
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        _skip(f"{path}: unreadable ({error}); the run's suite, command and environment are unknown", skipped)
        return {}
    if not isinstance(info, dict):
        _skip(f"{path}: not a JSON object; the run's suite, command and environment are unknown", skipped)
        return {}
    return info


def load_records(run_dir: Path, skipped: list[str] | None = None) -> list[Record]:
    """The run's cell records, migrated to SCHEMA_VERSION: every trial of every cell (``--repeat
    N`` records N per cell), the last record of each (cell, trial) (a resumed run with
    --retry-failed appends a new one), in order of each one's first record. Readers that want
    one record per cell fold the trials with harness.results.trials.aggregate.

    A line that cannot be read (truncated or corrupt anywhere in the file, not a cell record,
    a newer or unknown schema_version) is skipped with a DamagedResultsWarning naming the file
    and line number; the messages are also appended to ``skipped`` when given.
    """
    path = run_dir / "cells.jsonl"
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    records: dict[tuple[str, int], Record] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            _skip(f"{where}: skipped, not a complete JSON line ({error.msg} at column {error.colno})", skipped)
            continue
        if not (isinstance(record, dict) and isinstance(record.get("cell_id"), str)
                and isinstance(record.get("status"), str)):
            _skip(f"{where}: skipped, not a cell record (no cell_id and status)", skipped)
            continue
        try:
            record = migrate(record)
        except UnreadableRecord as error:
            _skip(f"{where}: skipped, {error}", skipped)
            continue
        trial = record.get("trial")
        if not isinstance(trial, int) or isinstance(trial, bool) or trial < 0:
            _skip(f"{where}: skipped, trial={trial!r} is not a trial number (0, 1, ...)", skipped)
            continue
        records[record["cell_id"], trial] = record
    return list(records.values())


def resolve_run(results_dir: Path, run: str) -> Path:
    path = Path(run)
    if not path.is_dir():
        path = results_dir / run
    if not (path / "cells.jsonl").exists() and not (path / "run.json").exists():
        raise ValueError(f"no run at {path}: give a run id under {results_dir} or a run folder")
    return path.resolve()
