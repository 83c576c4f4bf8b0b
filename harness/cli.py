"""``python -m harness`` / ``shardbench``: run a suite, list its cells, rebuild a report,
publish the reports, compare two runs, plan a configuration before renting the GPUs.

This module is the parser; each command lives in a cli_*.py of its own. Arguments are checked
before anything is launched: a bad suite, marker, world size or path gets a one-line error
naming the allowed values and exit status 2.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from importlib import metadata
from pathlib import Path
from typing import get_args

from harness import suites
from harness.cli_catalogue import CATALOGUES
from harness.cli_common import EXIT_USAGE, UsageError
from harness.cli_list import cmd_list
from harness.cli_plan import cmd_plan
from harness.cli_report import cmd_accuracy, cmd_compare, cmd_publish, cmd_report, cmd_savings
from harness.cli_reproduce import cmd_reproduce
from harness.cli_run import cmd_run
from harness.cli_selection import SELECTION
from harness.config import Attention, Optimizer, add_run_options

RUN_HELP = "run id under results/ (or 'latest'), or a run folder"


class _OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (``--gpus abc``) as one line too, like every other bad input."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"shardbench: error: {self.prog.removeprefix('shardbench').strip() or 'shardbench'}:"
                              f" {message} (see --help)\n")


def _out_option(parser: argparse.ArgumentParser) -> None:
    """--out of the commands that read recorded runs."""
    parser.add_argument("--out", type=Path, default=None, help="folder holding results/ and reports/")


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """``command``'s own parser: its flags, and its errors named after it."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="shardbench", description="Distributed training strategies, side by side.")
    parser.add_argument("--version", action="version", version=f"shardbench {metadata.version('shardbench')}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a suite (extra arguments go to pytest)",
                         description="Run a suite's cells and write results/ and reports/. Arguments shardbench does"
                                     " not take go to pytest unchanged (e.g. -x, --maxfail 3, -v); a mistyped flag of"
                                     " shardbench's own is refused, naming the closest one.")
    add_run_options(run.add_argument, "cli", suite_names=suites.SUITES)
    run.set_defaults(func=cmd_run)
    lst = sub.add_parser("list", help="show the cells a selection runs, without running them; or what a cell"
                                      " can be: models, strategies, options, markers")
    # Checked by cmd_list, after a mistyped flag's "did you mean" (its value would land here).
    lst.add_argument("what", nargs="?", default="cells",
                     help=f"cells (default: the selection's), or what suites and -m accept: {', '.join(CATALOGUES)}")
    add_run_options(lst.add_argument, "cli", only=SELECTION, suite_names=suites.SUITES)
    lst.add_argument("--calibration", default=None, metavar="RUN",
                     help="time a GPU target (--device cuda --gpus N --gpu-mem M) at the rates a CUDA run measured"
                          " (its results directory, its run.json, or harness.calibration's JSON) instead of"
                          " datasheet assumptions")
    lst.set_defaults(func=cmd_list)
    rep = sub.add_parser("report", help="rebuild a run's HTML report from its results")
    rep.add_argument("run", help=RUN_HELP)
    _out_option(rep)
    rep.set_defaults(func=cmd_report)
    pub = sub.add_parser("publish", help="copy reports/ into a folder ready for static hosting")
    pub.add_argument("destination", type=Path, help="a new (or empty) folder")
    _out_option(pub)
    pub.set_defaults(func=cmd_publish)
    cmp_ = sub.add_parser("compare", help="compare run B with baseline run A, cell by cell")
    cmp_.add_argument("run_a", help=f"baseline: {RUN_HELP}")
    cmp_.add_argument("run_b", help=f"candidate: {RUN_HELP}")
    cmp_.add_argument("--format", choices=("text", "markdown", "html"), default="text")
    cmp_.add_argument("--fail-on", default=None, metavar="SPEC",
                      help="exit 1 on regressions beyond e.g. mem:5%%,time:10%%,throughput:10%%"
                           " (a change counts only once marked worse: time/throughput beyond 10%%, memory 0.5%%)")
    _out_option(cmp_)
    cmp_.set_defaults(func=cmd_compare)
    pln = sub.add_parser("plan", help="predicted memory and step time per GPU of every strategy: the fastest that"
                                         " fits, before you rent it")
    pln.add_argument("--model", required=True,
                     help="a model preset (e.g. llama3-8b) or a transformers config.json (README: Models)")
    pln.add_argument("--gpus", type=int, required=True, help="GPUs in the job (all nodes)")
    pln.add_argument("--gpu-mem", required=True, help="memory per GPU with its unit, e.g. 80GiB or 40GB")
    pln.add_argument("--host-mem", default=None,
                     help="host memory per node with its unit, e.g. 2TiB: what a configuration's offload holds"
                          " there is checked against it (default: shown, not checked)")
    pln.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default 1)")
    pln.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    pln.add_argument("--micro-batch", type=int, default=None,
                     help="samples per GPU per micro-step, per tensor-parallel group under tp_fsdp (default:"
                          " each configuration's largest that fits the global batch)")
    pln.add_argument("--inter-node-bw", default=None,
                     help="what each node's network sends to the others, with its unit, e.g. 400Gbps or 3.2Tbps"
                          " (all its NICs; bits as NICs are rated) or 50GB/s: collectives across --nodes are"
                          " priced at it (default: 8 × 400 Gb/s assumed)")
    pln.add_argument("--global-batch", type=int, default=None,
                     help="samples per optimizer step over all GPUs, the rest accumulated (default: one"
                          " micro-batch per GPU)")
    pln.add_argument("--precision", default="bf16", help="fp32, bf16 or fp16 (default bf16)")
    pln.add_argument("--optimizer", default="adamw", help=f"{', '.join(get_args(Optimizer))} (default adamw)")
    pln.add_argument("--attention", default=None,
                     help=f"{', '.join(get_args(Attention))} (default: sdpa where the model's transformers class"
                          " has it, else eager)")
    pln.add_argument("--traced", action="store_true",
                     help="also trace the fastest fitting configurations and --config's under FakeTensorMode"
                          " (exact; slower); a traced peak over the usable memory is not a fit")
    pln.add_argument("--config", default=None, metavar="LABEL",
                     help="a configuration to hold beside the recommendation, as the table labels it,"
                          " e.g. fsdp_full/bf16/ckpt_full or tp_fsdp/tp4/sp/lossp/bf16/ckpt_none")
    pln.add_argument("--gpu", default=None, metavar="NAME",
                     help="the GPU to price steps on at its datasheet peaks, as torch.cuda.get_device_name()"
                          " names it or by words naming one, e.g. A100-SXM4-80GB or H200 (default: NVIDIA H100 80GB"
                          " HBM3)")
    pln.add_argument("--calibration", default=None, metavar="RUN",
                     help="price steps at the rates a run measured (its results directory, its run.json, or"
                          " harness.calibration's JSON) instead of datasheet assumptions")
    pln.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    pln.set_defaults(func=cmd_plan)
    rpr = sub.add_parser("reproduce", help="rerun one recorded cell from its record and compare")
    rpr.add_argument("run", help=RUN_HELP)
    rpr.add_argument("cell_id", help="the cell's id, as in the record")
    add_run_options(rpr.add_argument, "cli", only=("cell_timeout_s",))
    _out_option(rpr)
    rpr.set_defaults(func=cmd_reproduce)
    acc = sub.add_parser("accuracy", help="predicted vs measured memory and communication of a run's cells")
    acc.add_argument("run", nargs="?", default="latest",
                     help="run id under results/ (default: latest), or a run folder")
    acc.add_argument("--strict", action="store_true", help="exit 1 when any cell misses a ±10%% target")
    _out_option(acc)
    acc.set_defaults(func=cmd_accuracy)
    sav = sub.add_parser("savings", help="each ZeRO stage's memory saving against DDP, beside the ZeRO formula")
    sav.add_argument("run", nargs="?", default="latest",
                     help="run id under results/ (default: latest), or a run folder")
    _out_option(sav)
    sav.set_defaults(func=cmd_savings)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = _command_parser(parser, args.command)
    flags = [flag for flag in command._option_string_actions if flag.startswith("--")]
    mistyped = [(arg, close[0]) for arg in extra if arg.startswith("--")
                for close in [difflib.get_close_matches(arg.split("=")[0], flags, n=1, cutoff=0.75)] if close]
    if mistyped:  # run's other arguments go to pytest, but not one that is a typo of its own
        arg, close = mistyped[0]
        command.error(f"unrecognized argument {arg}: did you mean {close}?")
    if extra and args.command != "run":
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra)
    except UsageError as error:
        print(f"shardbench: error: {error}", file=sys.stderr)
        return EXIT_USAGE
