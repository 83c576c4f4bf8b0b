"""The cells ``run`` and ``list`` select: the selection checked before pytest starts (a bad
suite, marker or world size is one line and exit status 2), and pytest's arguments for it."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from harness import markers, suite_files, suites, suites_gpu
from harness.cli_common import REPO_ROOT, UsageError
from harness.config import RunOptions

SUITES_DIR = REPO_ROOT / "suites"
# The options that say which cells run (and where), all that `list` takes.
SELECTION = ("suite", "device", "gpus", "gpu_mem", "marker_expression", "keyword_expression", "max_cells")


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

    from harness.distributed import device_type, job_world_size, selected_device

    use_device(options)
    try:
        on_cuda = selected_device() == "cuda"
        what_if = listing and on_cuda and options.gpu_mem is not None and options.gpus is not None
        if not what_if:
            device_type()  # ValueError where --device cuda names a GPU this host does not have
        if on_cuda and not what_if and options.gpus is not None and options.gpus > torch.cuda.device_count():
            raise UsageError(f"--gpus {options.gpus}: this host has {torch.cuda.device_count()} visible GPU(s);"
                             " use fewer, or --device cpu for CPU ranks")
        progress = None
        if suite_files.is_suite_file(options.suite):
            # pytest and a resumed run must find the file wherever they are started from.
            options = dataclasses.replace(options, suite=str(Path(options.suite).resolve()))
            listed = suite_files.size(Path(options.suite))
            _check_cell_count(listed, options, f"--suite {options.suite} lists")
            progress = _building_progress(listed)
        gpu = suites_gpu.target(options.gpu_mem_bytes)
        cells = suites.cells_of(options.suite, job_world_size(options.gpus, nnodes), nnodes, gpu, progress)
        _check_cell_count(len(cells), options, f"suite {options.suite} has")
        markers.check_world_sizes(cells)
        if options.marker_expression:
            markers.check_marker_expression(options.marker_expression, cells)
        if options.keyword_expression:
            markers.check_keyword_expression(options.keyword_expression)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not on_cuda:
        _check_cpu_ranks(max([options.gpus or 2, *(c.world_size // nnodes for c in cells)]))
    return options


def _check_cell_count(count: int, options: RunOptions, what: str) -> None:
    if count > options.max_cells:
        raise UsageError(f"{what} {count:,} cells, more than --max-cells {options.max_cells:,}: narrow it (a suite"
                         f" file's axes multiply), or pass --max-cells {count} if you mean it")


# Suites this large get a progress line per tenth while their cells are built and checked.
PROGRESS_FROM_CELLS = 1000


def _building_progress(total: int) -> Callable[[int], None] | None:
    if total < PROGRESS_FROM_CELLS:
        return None
    started = time.monotonic()

    def built(count: int) -> None:
        if count * 10 // total != (count - 1) * 10 // total:
            print(f"shardbench: building cells: {count:,} of {total:,} ({time.monotonic() - started:.0f} s)",
                  file=sys.stderr, flush=True)
    return built


# CPU ranks per core beyond which a run is refused: each rank is a process with its own model,
# optimizer and gloo threads, and past a few per core the ranks spend the run waiting on each other.
CPU_RANKS_PER_CORE = 4


def _check_cpu_ranks(ranks: int) -> None:
    """Refuse more CPU ranks on this node than CPU_RANKS_PER_CORE per core; note more than one."""
    cores = os.cpu_count() or 1
    if ranks > CPU_RANKS_PER_CORE * cores:
        raise UsageError(f"{ranks} CPU ranks on this node: more than {CPU_RANKS_PER_CORE} per core on its {cores}"
                         f" cores ({CPU_RANKS_PER_CORE * cores}), where the ranks would spend the run waiting on"
                         " each other; use fewer (--gpus, or world_size in the suite file), or GPUs")
    if ranks > cores:
        # Allowed (memory and communication are still measured right), but said out loud.
        print(f"shardbench: note: {ranks} CPU ranks on {cores} cores: ranks share cores,"
              " so step times are not comparable to a run with a core per rank", file=sys.stderr)


def pytest_args(options: RunOptions) -> list[str]:
    """pytest's arguments for a session of the suites with these options (--device goes by
    the environment, ``use_device``)."""
    return [str(SUITES_DIR), "-p", "no:cacheprovider", "-o", "console_output_style=classic",
            *options.to_args("pytest")]
