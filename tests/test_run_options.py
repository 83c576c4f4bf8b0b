"""RunOptions, a run's options declared once: bad values refused in the user's terms, and the
options surviving each hop (CLI → pytest plugin → worker) exactly, the memory cap to the byte."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from harness.config import RunOptions, Surface, add_run_options, gib_of


def parser_of(surface: Surface) -> argparse.ArgumentParser:
    """The surface's parser of run options; for pytest, with pytest's own -m and -k beside them."""
    parser = argparse.ArgumentParser()
    add_run_options(parser.add_argument, surface, suite_names=("smoke", "default"))
    if surface == "pytest":
        parser.add_argument("-m", dest="markexpr", default="")
        parser.add_argument("-k", dest="keyword", default="")
    return parser


@pytest.mark.parametrize("options, message", [
    ({"gpus": 0}, "--gpus 0: must be a positive number of ranks per node"),
    ({"cell_timeout_s": -5.0}, "--cell-timeout -5.0: must be a positive, finite number of seconds"),
    ({"mem_cap_gib": 0.0}, "--mem-cap-gib 0.0: must be a positive number of GiB per rank"),
    ({"repeat": 0}, "--repeat 0: must be 1 or more trials per cell"),
    ({"retry_failed": True}, "--retry-failed: only with --resume RUN_ID"),
    ({"device": "tpu"}, "--device tpu: choose one of cpu, cuda"),
])
def test_bad_values_are_refused_naming_the_flag(options, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        RunOptions(**options)
    with pytest.raises(ValueError):
        dataclasses.replace(RunOptions(), **options)  # a changed copy is checked too


def test_nothing_given_is_the_defaults_and_no_arguments():
    args = parser_of("cli").parse_args([])
    assert RunOptions.given(args, "cli") == {}
    assert RunOptions.from_args(args, "cli") == RunOptions()
    assert RunOptions().to_args("pytest") == [] and RunOptions().to_args("worker") == []


def test_options_survive_the_hop_from_the_cli_to_pytest_and_the_worker():
    argv = ["--suite", "smoke", "--device", "cpu", "--gpus", "3", "-m", "ddp and fp32", "-k", "gpt2", "--out", "/tmp/o",
            "--cell-timeout", "90", "--mem-cap-gib", "0.1", "--repeat", "2", "--memory-snapshot", "--nnodes", "2",
            "--node-rank", "0", "--master-addr", "n01", "--master-port", "29600", "--resume", "/tmp/o/results/r1",
            "--retry-failed"]
    given = RunOptions.from_args(parser_of("cli").parse_args(argv), "cli")
    assert given.suite == "smoke" and given.marker_expression == "ddp and fp32" and given.out == Path("/tmp/o")
    assert given.mem_cap_bytes == int(0.1 * 2**30)
    in_pytest = RunOptions.from_args(parser_of("pytest").parse_args(given.to_args("pytest")), "pytest")
    assert in_pytest == dataclasses.replace(given, device=None)  # the device goes by the environment
    in_worker = RunOptions.from_args(parser_of("worker").parse_args(given.to_args("worker")), "worker")
    assert in_worker == RunOptions(mem_cap_gib=given.mem_cap_gib)  # all a rank reads


@pytest.mark.parametrize("cap_bytes", [1, 2**30, 123_456_789, 80 * 2**30 - 1])
def test_a_recorded_memory_cap_reaches_the_worker_to_the_byte(cap_bytes):
    options = RunOptions(mem_cap_gib=gib_of(cap_bytes))
    in_worker = RunOptions.from_args(parser_of("worker").parse_args(options.to_args("worker")), "worker")
    assert in_worker.mem_cap_bytes == cap_bytes


def test_the_plugin_keeps_pytests_own_m_and_k_and_the_cli_has_them():
    cli_flags = {action.option_strings[0] for action in parser_of("cli")._actions if action.option_strings}
    plugin = argparse.ArgumentParser(add_help=False)
    add_run_options(plugin.add_argument, "pytest")
    plugin_flags = {action.option_strings[0] for action in plugin._actions}
    assert {"-m", "-k", "--device"} <= cli_flags
    # --device travels by the environment; --max-cells is checked before pytest starts.
    assert plugin_flags == cli_flags - {"-h", "-m", "-k", "--device", "--max-cells"}
