"""``python -m harness reproduce RUN CELL``: run one recorded cell again from its record alone
and say whether it trained bitwise the same and how far its measurements moved.

The cell spec comes from the record (``record["cell"]``), the device type from the run's
run.json; the new launch's logs go under results/<run>/reproduce/<time>/. Losses are compared
exactly: fp32 on the CPU is deterministic here (same seed, same data, one OMP thread per rank),
so any difference there is a finding, and the command exits 1. Elsewhere (bf16/fp16, CUDA
kernels) the largest relative difference is reported. The cell version (config + harness
code, harness/results/provenance.py) says whether the code changed since the record.
"""

from __future__ import annotations

import time
from pathlib import Path

from harness.config import CellSpec, RunOptions, gib_of
from harness.measure import summary
from harness.results import provenance, trials
from harness.results.schema import _finite_or_none
from harness.results.store import load_records, load_run_info
from harness.runner.launcher import CellOutcome, LaunchOptions, run_batch

COMPARED = (("peak_mem_bytes", "peak memory per rank"), ("step_time_s", "step time"),
            ("comm_bytes_per_step", "communication bytes per step"))


def find_record(run_dir: Path, cell_id: str) -> dict:
    """The cell's record in the run, its trials folded (harness/results/trials.py: with
    --repeat, the medians over its trials, and the losses of the trial whose step time is
    nearest the median); ValueError (one line) if it has none or no measurement."""
    records = {r["cell_id"]: r for r in trials.aggregate(load_records(run_dir))}
    if cell_id not in records:
        raise ValueError(f"no cell {cell_id!r} in run {run_dir.name}: it has {len(records)} cells"
                         f" (python -m harness report {run_dir.name} lists them)")
    record = records[cell_id]
    if record["status"] != "ok":
        trial = f" (trial {record['trial']} of {record['trials']['n']})" if record["trials"]["n"] > 1 else ""
        raise ValueError(f"{cell_id} ended {record['status']!r}{trial} in run {run_dir.name}: there is no"
                         " measurement to reproduce")
    return record


def device_of(run_dir: Path) -> str | None:
    return (load_run_info(run_dir).get("device") or {}).get("type")


def _max_rel_diff(old: list, new: list) -> float:
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(old, new) if a is not None and b is not None]
    return max(diffs, default=0.0)


def reproduce(run_dir: Path, record: dict, device_type: str, cell_timeout_s: float | None) -> tuple[str, bool]:
    """Rerun the record's cell; the report text and whether it reproduced (bitwise where
    expected, else merely completed)."""
    cell = CellSpec.from_dict(record["cell"])
    workdir = run_dir / "reproduce" / time.strftime("%Y%m%d-%H%M%S")
    outcomes: list[CellOutcome] = []
    info = load_run_info(run_dir)
    limits = RunOptions(cell_timeout_s=cell_timeout_s, mem_cap_gib=gib_of(info.get("mem_cap_bytes")))
    options = LaunchOptions(run=limits, device_type=device_type, device_name=(info.get("device") or {}).get("name"))
    run_batch([cell], options, workdir, outcomes.append)
    outcome = outcomes[0]
    lines = [f"reproducing {cell.cell_id} of run {run_dir.name} (logs: {workdir})"]
    if record["trials"]["n"] > 1:
        lines.append(f"against the median of its {record['trials']['n']} trials; losses of trial {record['trial']},"
                     " the one whose step time is nearest the median")
    then = record.get("provenance") or {}
    now = provenance.of(cell)
    if then.get("cell_version") == now["cell_version"]:
        lines.append(f"cell version {now['cell_version']}: same config, same harness code")
    else:
        lines.append(f"cell version {then.get('cell_version', 'unknown')} -> {now['cell_version']}:"
                     f" harness code {then.get('harness_code_hash', 'unknown')} -> {now['harness_code_hash']}")
    if outcome.status != "ok":
        lines.append(f"the rerun ended {outcome.status}: {outcome.reason.splitlines()[-1] if outcome.reason else ''}")
        return "\n".join(lines), False
    new_losses = _finite_or_none(outcome.per_rank[0]["losses"])
    old_losses = record["losses"]
    bitwise = new_losses == old_losses
    expect_bitwise = cell.strategy.precision == "fp32" and device_type == "cpu"
    if bitwise:
        lines.append(f"losses: bitwise equal ({len(new_losses)} steps)")
    else:
        lines.append(f"losses: differ, max relative difference {_max_rel_diff(old_losses, new_losses):.3g}"
                     + (" (fp32 on CPU should be bitwise equal)" if expect_bitwise else ""))
    metrics = summary.summarize(cell, outcome.per_rank, None)
    for key, label in COMPARED:
        old, new = record["metrics"].get(key), metrics.get(key)
        if old:
            lines.append(f"{label}: {old:.6g} -> {new:.6g} ({new / old - 1:+.1%})")
        else:
            lines.append(f"{label}: {old} -> {new}")
    return "\n".join(lines), bitwise or not expect_bitwise
