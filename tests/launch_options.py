"""Launch options for tests that run cells through MatrixRun without checking the traced
prediction: the trace every run starts with (a subprocess that imports torch and traces each
cell, 10-30 s here) is skipped, as ``--no-trace`` skips it."""

from harness.config import RunOptions
from harness.runner.launcher import LaunchOptions


def untraced(**run_options) -> LaunchOptions:
    return LaunchOptions(run=RunOptions(no_trace=True, **run_options))
