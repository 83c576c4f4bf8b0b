"""What the commands of ``python -m harness`` share: the one-line refusal (``UsageError``: exit
status 2, nothing run), the repository root, and reading the run options, recorded runs and
measured rates (``--calibration`` of ``plan`` and ``list``) a command is given."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from harness.config import RunOptions

if TYPE_CHECKING:
    from harness.predict.rough_time import Rates

REPO_ROOT = Path(__file__).resolve().parents[1]
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input, refused before anything runs: one line on stderr and exit status 2."""


def run_options(args: argparse.Namespace) -> RunOptions:
    """The run options the command line gives (those its command takes), checked."""
    try:
        return RunOptions.from_args(args, "cli")
    except ValueError as error:
        raise UsageError(str(error)) from None


def recorded_run(out: Path | None, run: str) -> Path:
    """The folder of run ``run``: an id under <out>/results/ (the repo's by default), 'latest',
    or a run folder."""
    from harness.results.store import resolve_run

    try:
        return resolve_run((out or REPO_ROOT) / "results", run)
    except ValueError as error:
        raise UsageError(str(error)) from None


def measured_rates(path: str, inter_node_bytes_per_s: float | None = None) -> tuple[Rates, Path | None]:
    """--calibration's rates: those a run measured (its results directory or its run.json,
    with its sweep across nodes where it ran on several) or ``python -m harness.calibration
    --out`` wrote, and the run's directory (None for the latter); what crosses nodes at
    ``inter_node_bytes_per_s`` where given (rough_time.measured); UsageError naming ``path``
    where it is neither or measured no compute rates."""
    from harness.predict import rough_time

    file = Path(path) / "run.json" if Path(path).is_dir() else Path(path)
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"--calibration {path}: cannot read {file}: {error}") from None
    across = None
    if isinstance(data, dict) and isinstance(data.get("environment"), dict):
        calibration, name, run_dir = (data["environment"].get("bandwidth") or {},
                                      f"{path} (run {data.get('run_id', '?')})", file.parent)
        across = data["environment"].get("bandwidth_across_nodes")
    elif isinstance(data, dict) and "compute_rates" in data:
        calibration, name, run_dir = data, path, None
    else:
        raise UsageError(f"--calibration {path}: neither a run's run.json nor a calibration's JSON (no compute_rates)")
    try:
        return rough_time.measured(calibration, name, across, inter_node_bytes_per_s), run_dir
    except ValueError as error:
        raise UsageError(f"--calibration {error}") from None
