"""Resuming a run (``run --resume RUN_ID``): the same selection and the same ``--repeat``,
only the (cell, trial) pairs without a kept record, appended to the same cells.jsonl; and
ending a run cleanly on SIGTERM / SIGINT.

What is kept: every recorded outcome, per (cell, trial). ``ok`` and ``unsupported`` always;
``failed``, ``timeout`` and ``oom`` are outcomes a cell completed with, so they are kept too
unless ``--retry-failed`` asks to run those trials again (their new record is appended; the
loader takes the last record of each (cell, trial)). A kept reference is not re-run: the
cells gated against it read its recorded losses.
"""

from __future__ import annotations

import signal
import time
import warnings
from pathlib import Path

from harness.results.store import DamagedResultsWarning, RunStore, load_records, load_run_info

RETRIABLE = ("failed", "timeout", "oom")
# Fields of run.json that fix what a run selects; a resume must select the same cells.
SELECTION = (("suite", "--suite"), ("marker_expression", "-m"), ("keyword_expression", "-k"),
             ("world_size", "--gpus"))


def original_selection(run_dir: Path) -> dict:
    """suite, marker and keyword expressions, world size, device and repeat of the run at
    ``run_dir``; ValueError (one line) when its run.json cannot tell."""
    with warnings.catch_warnings():  # the one-line error below says it all
        warnings.simplefilter("ignore", DamagedResultsWarning)
        info = load_run_info(run_dir)
    missing = [key for key, _ in SELECTION if key not in info]
    if missing:
        raise ValueError(f"cannot resume {run_dir}: its run.json is missing or lacks {', '.join(missing)},"
                         " so the original selection is unknown; start a new run")
    return {**{key: info[key] for key, _ in SELECTION},
            "device": (info.get("device") or {}).get("type"),
            "nnodes": (info.get("nodes") or {}).get("nnodes", 1),
            "repeat": info.get("repeat", 1),  # runs from before --repeat ran each cell once
            "mem_cap_bytes": info.get("mem_cap_bytes"),
            "gpu_mem": info.get("gpu_mem")}  # runs from before --gpu-mem sized for their GPU's own


def check_same_selection(run_dir: Path, original: dict, asked: dict) -> None:
    """ValueError (one line) naming the first option that differs from the original run's
    (``asked`` holds only the options the user gave, by run.json key)."""
    if "nnodes" in asked and asked["nnodes"] != original["nnodes"]:
        # Checked first: the world size below is nodes × ranks per node. A node count cannot be
        # left out: every node must be started again.
        raise ValueError(f"cannot resume {run_dir.name} on {asked['nnodes']} node(s): it ran on {original['nnodes']};"
                         " start as many nodes again, or start a new run")
    for key, option in (*SELECTION, ("device", "--device"), ("repeat", "--repeat"), ("mem_cap_bytes", "--mem-cap-gib"),
                        ("gpu_mem", "--gpu-mem")):
        if key in asked and asked[key] != original.get(key):
            raise ValueError(f"cannot resume {run_dir.name} with {option} {_as_given(key, asked)}: it ran with"
                             f" {option} {_as_given(key, original)}; resume without {option}, or start a new run")


def _as_given(key: str, selection: dict) -> str:
    """An option's value as the user gives it: --gpus is ranks per node, run.json's world
    size is over every node."""
    if key == "world_size":
        return repr(selection["world_size"] // selection.get("nnodes", 1))
    return repr(selection.get(key))


def kept_records(records: list[dict], *, retry_failed: bool) -> dict[tuple[str, int], dict]:
    """(cell_id, trial) -> the recorded outcome that stands (the loader already took the last
    of each)."""
    return {(r["cell_id"], r["trial"]): r for r in records if not (retry_failed and r["status"] in RETRIABLE)}


def begin(store: RunStore, *, command: list[str], retry_failed: bool) -> dict[tuple[str, int], dict]:
    """Note the resume in run.json and return the records to keep."""
    info = load_run_info(store.path)
    info["resumes"] = [*info.get("resumes", []), {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command, "retry_failed": retry_failed}]
    store.write_run_info(info)
    return kept_records(load_records(store.path), retry_failed=retry_failed)


class Interrupted:
    """SIGTERM and SIGINT raise KeyboardInterrupt in the driver, so every launch's ``finally``
    kills its torchrun and workers (Python's default SIGTERM ends the process at once and would
    leave them running); ``signum`` is the signal received, for the 128 + N exit status."""

    signum: int | None = None

    @classmethod
    def install(cls) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, cls._handle)

    @classmethod
    def _handle(cls, signum, frame) -> None:
        cls.signum = signum
        raise KeyboardInterrupt(signal.Signals(signum).name)
