"""``python -m harness reproduce RUN CELL``: one recorded cell run again from its record
(harness/runner/reproduce.py): bitwise-equal losses? how far did its measurements move?"""

from __future__ import annotations

import argparse
import os

from harness.cli_common import UsageError, recorded_run, run_options


def cmd_reproduce(args: argparse.Namespace, extra: list[str]) -> int:
    """Rerun one recorded cell from its record: bitwise-equal losses? how far did it move?"""
    from harness.distributed import DEVICE_ENV_VAR, device_type
    from harness.runner import reproduce

    options = run_options(args)
    run_dir = recorded_run(args.out, args.run)
    try:
        record = reproduce.find_record(run_dir, args.cell_id)
        recorded_device = reproduce.device_of(run_dir) or "cpu"
        os.environ[DEVICE_ENV_VAR] = recorded_device  # the workers run where the record was made
        device_type()  # refuses cuda on a host without a GPU
    except ValueError as error:
        raise UsageError(str(error)) from None
    text, reproduced = reproduce.reproduce(run_dir, record, recorded_device, options.cell_timeout_s)
    print(text)
    return 0 if reproduced else 1
