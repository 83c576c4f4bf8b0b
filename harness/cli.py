"""``python -m harness`` / ``shardbench``: run a suite, list its cells, rebuild a report,
publish the reports, compare two runs, plan a configuration before renting the GPUs.

Arguments are checked before anything is launched: a bad suite, marker, world size or path
gets a one-line error naming the allowed values and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import pytest

from harness import markers, suite_files, suites
from harness.config import RunOptions, add_run_options, gib_of
from harness.runner.nodes import NodeSpec

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


SUITES_DIR = REPO_ROOT / "suites"
# The options that say which cells run (and where), all that `list` takes.
SELECTION = ("suite", "device", "gpus", "marker_expression", "keyword_expression")


def use_device(options: RunOptions) -> None:
    """--device: where the cells compute, read by pytest's session and every worker (a
    follower node's too: it runs no selection of its own, but its ranks compute here)."""
    from harness.distributed import DEVICE_ENV_VAR

    if options.device is not None:
        os.environ[DEVICE_ENV_VAR] = options.device


def check_selection(options: RunOptions, nnodes: int = 1) -> RunOptions:
    """Everything pytest would otherwise discover late, or silently accept (``-m zero4``);
    returns the options with a suite file's path made absolute."""
    import torch

    from harness.distributed import device_type
    from harness.runner.session import world_size

    use_device(options)
    try:
        on_cuda = device_type() == "cuda"
        if on_cuda and options.gpus is not None and options.gpus > torch.cuda.device_count():
            raise UsageError(f"--gpus {options.gpus}: this host has {torch.cuda.device_count()} visible GPU(s);"
                             " use fewer, or --device cpu for CPU ranks")
        if not on_cuda and (options.gpus or 2) > (os.cpu_count() or 1):
            # Allowed (memory and communication are still measured right), but said out loud.
            print(f"shardbench: note: {options.gpus or 2} CPU ranks on {os.cpu_count()} cores: ranks share cores,"
                  " so step times are not comparable to a run with a core per rank", file=sys.stderr)
        if suite_files.is_suite_file(options.suite):
            # pytest and a resumed run must find the file wherever they are started from.
            options = dataclasses.replace(options, suite=str(Path(options.suite).resolve()))
        suites.cells_of(options.suite, world_size(options.gpus, nnodes), nnodes)
        if options.marker_expression:
            markers.check_marker_expression(options.marker_expression)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return options


def pytest_args(options: RunOptions) -> list[str]:
    """pytest's arguments for a session of the suites with these options (--device goes by
    the environment, ``use_device``)."""
    return [str(SUITES_DIR), "-p", "no:cacheprovider", "-o", "console_output_style=classic",
            *options.to_args("pytest")]


def cmd_run(args: argparse.Namespace, extra: list[str]) -> int:
    from harness.runner import resume

    options = run_options(args)
    options, node = _resolve_nodes(options)
    if options.resume is not None and node.is_leader:  # the other nodes follow node 0's plan
        options = _resume_selection(options, RunOptions.given(args, "cli"), node)
    if node.is_leader:  # a follower runs node 0's selection, not its own
        options = check_selection(options, node.nnodes)
    else:
        use_device(options)
    if options.out is not None:
        if options.out.exists() and not options.out.is_dir():
            raise UsageError(f"--out {options.out}: exists and is not a folder")
        options.out.mkdir(parents=True, exist_ok=True)
        options = dataclasses.replace(options, out=options.out.resolve())
    _check_mem_cap_fits(options)
    if not node.is_leader:
        return _run_follower(options, node)
    code = int(pytest.main([*pytest_args(options), "-rfEs", *extra]))
    # Ended by SIGTERM / SIGINT: the shell's 128 + N, never 0 (the finished cells are kept).
    return 128 + resume.Interrupted.signum if resume.Interrupted.signum else code


def _resolve_nodes(options: RunOptions) -> tuple[RunOptions, NodeSpec]:
    """--nnodes/--node-rank/--master-addr/--master-port, else SLURM's variables (README
    "Several nodes"), checked before anything launches: this node's place in the job, and the
    options holding it (what pytest is handed: it reads no SLURM variables)."""
    from harness.distributed import device_type
    from harness.runner import nodes

    try:
        node = nodes.of_options(options)
        options = dataclasses.replace(options, **node.to_dict())
        # A resumed run keeps its own ranks per node (run.json), whatever the allocation offers.
        if (node.multi and options.gpus is None and options.resume is None
                and (options.device or device_type()) == "cuda"):  # a GPU node in a SLURM allocation
            options = dataclasses.replace(options, gpus=nodes.slurm_ranks_per_node())
    except ValueError as error:
        raise UsageError(str(error)) from None
    return options, node


def _resume_selection(options: RunOptions, given: dict[str, object], node: NodeSpec) -> RunOptions:
    """--resume: the run's own selection (suite, -m, -k, world size, device) from its run.json;
    an option ``given`` that differs from it is refused, as is a run that cannot be found."""
    from harness.distributed import DEVICES
    from harness.runner import resume
    from harness.runner.session import world_size

    run_dir = recorded_run(options.out, options.resume)
    try:
        original = resume.original_selection(run_dir)
        # The fields that run.json keeps under their own names.
        asked = {key: given[key] for key in ("suite", "marker_expression", "keyword_expression", "device", "repeat")
                 if key in given}
        asked["nnodes"] = node.nnodes
        if "mem_cap_gib" in given:
            asked["mem_cap_bytes"] = options.mem_cap_bytes
        if "gpus" in given:
            asked["world_size"] = world_size(options.gpus, node.nnodes)
        resume.check_same_selection(run_dir, original, asked)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return dataclasses.replace(
        options, resume=str(run_dir), suite=original["suite"], marker_expression=original["marker_expression"],
        keyword_expression=original["keyword_expression"], gpus=original["world_size"] // original["nnodes"],
        mem_cap_gib=options.mem_cap_gib if original["mem_cap_bytes"] is None else gib_of(original["mem_cap_bytes"]),
        device=original["device"] if options.device is None and original["device"] in DEVICES else options.device,
        out=run_dir.parent.parent if options.out is None else options.out)  # reports/ beside the run's results/


def _run_follower(options: RunOptions, node: NodeSpec) -> int:
    """A node of rank > 0: its ranks of the launches node 0 serves (its selection, or what its
    resumed run still lacks), nothing under results/ (runner/nodes.py)."""
    from harness.distributed import device_type
    from harness.results.provenance import harness_code_hash
    from harness.results.store import new_run_id
    from harness.runner import nodes
    from harness.runner.launcher import LaunchOptions

    wait_s = max(nodes.PLAN_WAIT_S, options.cell_timeout_s or 0)
    print(f"shardbench: node {node.node_rank}: waiting for node 0's plan at {node.master_addr}:"
          f"{node.plan_port} (up to {wait_s:.0f} s)", flush=True)
    try:
        plan = nodes.fetch_plan(node, harness_code_hash(), wait_s)
    except ValueError as error:
        print(f"shardbench: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    launch_dir = (options.out or REPO_ROOT).resolve() / "node-launches" / f"node{node.node_rank}-{new_run_id()}"
    # Node 0's limits, not this node's options: every rank of a launch must agree on them.
    limits = RunOptions(cell_timeout_s=plan.cell_timeout_s, mem_cap_gib=gib_of(plan.mem_cap_bytes))
    launch = LaunchOptions(run=limits, nodes=node, device_type=device_type(), device_name=_device_name())
    return nodes.run_follower(plan, launch, launch_dir)


def _device_name() -> str | None:
    import torch

    from harness.distributed import device_type

    return torch.cuda.get_device_name() if device_type() == "cuda" else None


def _check_mem_cap_fits(options: RunOptions) -> None:
    """--mem-cap-gib on CUDA: no more than the GPU has (RunOptions checks it is positive)."""
    import torch

    from harness.distributed import device_type

    if options.mem_cap_bytes is None or device_type() != "cuda":
        return
    total = torch.cuda.get_device_properties(0).total_memory
    if options.mem_cap_bytes > total:
        raise UsageError(f"--mem-cap-gib {options.mem_cap_gib}: more than the {total / 2**30:.1f} GiB"
                         f" of {torch.cuda.get_device_name(0)}; give at most that")


class _Collector:
    """The cells the session would run, as the suites' conftest files selected them (matrix
    tests by their ``cell``, claims by the cells the selected claims read)."""

    def __init__(self) -> None:
        self.cells = []

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_finish(self, session):
        from harness.runner.session import SELECTED

        yield
        self.cells = session.config.stash.get(SELECTED, [])


def cmd_list(args: argparse.Namespace, extra: list[str]) -> int:
    """The cells pytest would select (its own collection, so selection is identical)."""
    from harness import strategies
    from harness.runner.matrix import with_references

    options = check_selection(run_options(args))
    if options.suite in suites.BENCHMARK_SUITES:
        print(f"suite {options.suite} benchmarks the harness itself (suites/test_perf.py): run it with"
              f" ./run_all.sh --suite {options.suite}")
        return 0
    collector = _Collector()
    code = pytest.main(pytest_args(options) + ["--collect-only", "-p", "no:terminal"], plugins=[collector])
    if code not in (0, 5):  # 5: nothing selected, still a valid listing
        print(f"shardbench: error: collecting {SUITES_DIR} failed (pytest exit {int(code)});"
              f" `pytest {SUITES_DIR} --collect-only` shows why", file=sys.stderr)
        return int(code)
    from harness.distributed import device_type

    added = [c for c in with_references(collector.cells) if c not in collector.cells]
    for cell in collector.cells:
        reason = strategies.unsupported_reason(cell, device_type())
        note = f"  [unsupported here: {reason}]" if reason else ""
        print(f"{cell.cell_id:<62} {' '.join(markers.markers_of(cell))}{note}")
    for cell in added:
        print(f"{cell.cell_id:<62} (reference, added to gate the selection)")
    print(f"{len(collector.cells)} cells selected, {len(added)} references added")
    return 0


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from harness.report import history, html

    root = args.out or REPO_ROOT
    run_dir = recorded_run(args.out, args.run)
    skipped: list[str] = []
    page = html.write_run_report(run_dir, root / "reports" / run_dir.name, skipped)
    history.write_index(root / "results", root / "reports")
    if skipped:
        print(f"shardbench: skipped {len(skipped)} unreadable item(s) of {run_dir} (warnings above, and in the report)",
              file=sys.stderr)
    print(page)
    return 0


def cmd_publish(args: argparse.Namespace, extra: list[str]) -> int:
    from harness.report import history

    root = args.out or REPO_ROOT
    try:
        page = history.publish(root / "reports", args.destination)
    except ValueError as error:
        raise UsageError(str(error)) from None
    print(page)
    return 0


def cmd_compare(args: argparse.Namespace, extra: list[str]) -> int:
    """Per common cell, B against A: better / worse / not significant; the HTML page goes
    into the report folder beside the runs' own reports."""
    from harness.report import compare

    try:
        compare.parse_thresholds(args.fail_on)
    except ValueError as error:
        raise UsageError(str(error)) from None
    run_a, run_b = (recorded_run(args.out, run) for run in (args.run_a, args.run_b))
    page = (args.out or REPO_ROOT) / "reports" / "compare" / f"{run_a.name}_vs_{run_b.name}.html"
    code = compare.main_compare(run_a, run_b, fmt=args.format, fail_on=args.fail_on, html_out=page)
    print(f"\ncomparison page: {page}", file=sys.stderr)
    return code


def cmd_accuracy(args: argparse.Namespace, extra: list[str]) -> int:
    """Predicted ÷ measured for every measured cell of a run, and the worst per target."""
    from harness.predict import accuracy
    from harness.results.store import load_records

    text, all_met = accuracy.report(load_records(recorded_run(args.out, args.run)))
    print(text)
    return 0 if all_met or not args.strict else 1


def cmd_plan(args: argparse.Namespace, extra: list[str]) -> int:
    """Predicted peak memory per GPU of every strategy and option combination."""
    from harness.features.precision import DTYPES
    from harness.predict import plan

    if args.precision not in DTYPES:
        raise UsageError(f"--precision {args.precision}: choose one of {', '.join(DTYPES)}")
    try:
        req = plan.PlanRequest(model=args.model, gpus=args.gpus, nodes=args.nodes, seq=args.seq,
                               micro_batch=args.micro_batch, gpu_mem_bytes=plan.parse_bytes(args.gpu_mem),
                               precision=args.precision, optimizer=args.optimizer)
    except ValueError as error:
        raise UsageError(str(error)) from None
    result = plan.plan(req)
    traced = None
    if args.traced and result["recommended"] is not None:
        from harness.predict import traced as tracer

        if args.seq is not None and args.seq != _preset_seq(args.model):
            traced = {"unavailable": f"the tracer runs the preset's sequence length ({_preset_seq(args.model)});"
                                     " drop --seq to trace"}
        else:
            cell = result["recommended"]["cell"]
            traced = tracer.trace_cells([cell])[cell.cell_id]
    if args.format == "json":
        print(plan.as_json(result, traced))
    else:
        print(plan.as_table(result, markdown=args.format == "markdown", traced=traced))
    return 0


def _preset_seq(model: str) -> int | None:
    from harness import models

    return models.get_preset(model).seq_len


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


RUN_HELP = "run id under results/ (or 'latest'), or a run folder"


class _OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (``--gpus abc``) as one line too, like every other bad input."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"shardbench: error: {self.prog.removeprefix('shardbench').strip() or 'shardbench'}:"
                              f" {message} (see --help)\n")


def _out_option(parser: argparse.ArgumentParser) -> None:
    """--out of the commands that read recorded runs."""
    parser.add_argument("--out", type=Path, default=None, help="folder holding results/ and reports/")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="shardbench", description="Distributed training strategies, side by side.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a suite (extra arguments go to pytest)")
    add_run_options(run.add_argument, "cli", suite_names=suites.SUITES)
    run.set_defaults(func=cmd_run)
    lst = sub.add_parser("list", help="show the cells a selection runs, without running them")
    add_run_options(lst.add_argument, "cli", only=SELECTION, suite_names=suites.SUITES)
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
    pln = sub.add_parser("plan", help="predicted memory per GPU of every strategy: what fits before you rent it")
    pln.add_argument("--model", required=True, help="a model preset, e.g. llama3-8b (see README Models)")
    pln.add_argument("--gpus", type=int, required=True, help="GPUs in the job (all nodes)")
    pln.add_argument("--gpu-mem", required=True, help="memory per GPU, e.g. 80GiB or 40GB")
    pln.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default 1)")
    pln.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    pln.add_argument("--micro-batch", type=int, default=1, help="samples per GPU per micro-step (default 1)")
    pln.add_argument("--precision", default="bf16", help="fp32, bf16 or fp16 (default bf16)")
    pln.add_argument("--optimizer", default="adamw", help="adamw, adam8bit, adamw8bit, adafactor (default adamw)")
    pln.add_argument("--traced", action="store_true",
                     help="also trace the recommended configuration under FakeTensorMode (exact; slower)")
    pln.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    pln.set_defaults(func=cmd_plan)
    rpr = sub.add_parser("reproduce", help="rerun one recorded cell from its record and compare")
    rpr.add_argument("run", help=RUN_HELP)
    rpr.add_argument("cell_id", help="the cell's id, as in the record")
    add_run_options(rpr.add_argument, "cli", only=("cell_timeout_s",))
    _out_option(rpr)
    rpr.set_defaults(func=cmd_reproduce)
    acc = sub.add_parser("accuracy", help="predicted vs measured memory and communication of a run's cells")
    acc.add_argument("run", nargs="?", default="latest", help="run id under results/ (default: latest), or a run folder")
    acc.add_argument("--strict", action="store_true", help="exit 1 when any cell misses a ±10%% target")
    _out_option(acc)
    acc.set_defaults(func=cmd_accuracy)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra)
    except UsageError as error:
        print(f"shardbench: error: {error}", file=sys.stderr)
        return EXIT_USAGE
