"""The cells ``run`` and ``list`` select: the selection checked before pytest starts (a bad
suite, marker or world size is one line and exit status 2), and pytest's arguments for it."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from harness import markers, suite_files, suites, suites_gpu
from harness.cli_common import REPO_ROOT, UsageError
from harness.config import RunOptions

SUITES_DIR = REPO_ROOT / "suites"
# The options that say which cells run (and where), all that `list` takes.
SELECTION = ("suite", "device", "gpus", "gpu_mem", "marker_expression", "keyword_expression")


def use_device(options: RunOptions) -> None:
    """--device: where the cells compute, read by pytest's session and every worker (a
    follower node's too: it runs no selection of its own, but its ranks compute here)."""
    from harness.distributed import DEVICE_ENV_VAR

    if options.device is not None:
        os.environ[DEVICE_ENV_VAR] = options.device


def check_selection(options: RunOptions, nnodes: int = 1, *, listing: bool = False) -> RunOptions:
    """Everything pytest would otherwise discover late, or silently accept (``-m zero4``);
    returns the options with a suite file's path made absolute. ``listing``: for ``list``,
    which may show a GPU node's matrix on a host without GPUs (--device cuda --gpus N --gpu-mem)."""
    import torch

    from harness.distributed import device_type, selected_device
    from harness.runner.session import world_size

    use_device(options)
    try:
        on_cuda = selected_device() == "cuda"
        what_if = listing and on_cuda and options.gpu_mem is not None and options.gpus is not None
        if not what_if:
            device_type()  # ValueError where --device cuda names a GPU this host does not have
        if on_cuda and not what_if and options.gpus is not None and options.gpus > torch.cuda.device_count():
            raise UsageError(f"--gpus {options.gpus}: this host has {torch.cuda.device_count()} visible GPU(s);"
                             " use fewer, or --device cpu for CPU ranks")
        if suite_files.is_suite_file(options.suite):
            # pytest and a resumed run must find the file wherever they are started from.
            options = dataclasses.replace(options, suite=str(Path(options.suite).resolve()))
        gpu = suites_gpu.target(options.gpu_mem_bytes)
        cells = suites.cells_of(options.suite, world_size(options.gpus, nnodes), nnodes, gpu)
        markers.check_world_sizes(cells)
        if options.marker_expression:
            markers.check_marker_expression(options.marker_expression, cells)
        if options.keyword_expression:
            markers.check_keyword_expression(options.keyword_expression)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not on_cuda and (options.gpus or 2) > (os.cpu_count() or 1):
        # Allowed (memory and communication are still measured right), but said out loud.
        print(f"shardbench: note: {options.gpus or 2} CPU ranks on {os.cpu_count()} cores: ranks share cores,"
              " so step times are not comparable to a run with a core per rank", file=sys.stderr)
    return options


def pytest_args(options: RunOptions) -> list[str]:
    """pytest's arguments for a session of the suites with these options (--device goes by
    the environment, ``use_device``)."""
    return [str(SUITES_DIR), "-p", "no:cacheprovider", "-o", "console_output_style=classic",
            *options.to_args("pytest")]
