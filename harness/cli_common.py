"""What the commands of ``python -m harness`` share: the one-line refusal (``UsageError``: exit
status 2, nothing run), the repository root, and reading the run options and recorded runs a
command is given."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.config import RunOptions

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
