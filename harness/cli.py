"""``python -m harness`` / ``shardbench``: run a suite, list its cells, rebuild a report,
publish the reports, compare two runs, plan a configuration before renting the GPUs.

Arguments are checked before anything is launched: a bad suite, marker, world size or path
gets a one-line error naming the allowed values and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

from harness import markers, suite_files, suites
from harness.distributed import DEVICES

REPO_ROOT = Path(__file__).resolve().parents[1]
SUITES_DIR = REPO_ROOT / "suites"
EXIT_USAGE = 2


class UsageError(Exception):
    pass


class _OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (``--gpus abc``) as one line too, like every other bad input."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"shardbench: error: {self.prog.removeprefix('shardbench').strip() or 'shardbench'}:"
                              f" {message} (see --help)\n")


def _selection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default="default",
                        help=f"one of {', '.join(suites.SUITES)} (default: default), or a .toml suite file"
                             " (README: Suites of your own)")
    parser.add_argument("--device", choices=DEVICES, default=None,
                        help="run cells on cpu (gloo) or cuda (NCCL); default: cuda where a GPU is visible")
    parser.add_argument("--gpus", type=int, default=None,
                        help="ranks per node: GPUs, or CPU processes where there are none (default: all GPUs, else 2)")
    parser.add_argument("-m", dest="markexpr", default="", help='pytest marker expression, e.g. "fsdp and bf16"')
    parser.add_argument("-k", dest="keyword", default="", help="pytest keyword expression on cell ids")


def _use_device(args: argparse.Namespace) -> None:
    """--device: where the cells compute, read by pytest's session and every worker (a
    follower node's too: it runs no selection of its own, but its ranks compute here)."""
    from harness.distributed import DEVICE_ENV_VAR

    if args.device is not None:
        os.environ[DEVICE_ENV_VAR] = args.device


def _check_selection(args: argparse.Namespace) -> None:
    """Everything pytest would otherwise discover late, or silently accept (``-m zero4``)."""
    import torch

    from harness.distributed import device_type
    from harness.runner.session import world_size

    _use_device(args)
    if args.gpus is not None and args.gpus < 1:
        raise UsageError(f"--gpus {args.gpus}: must be a positive number of ranks per node")
    try:
        on_cuda = device_type() == "cuda"
        if on_cuda and args.gpus is not None and args.gpus > torch.cuda.device_count():
            raise UsageError(f"--gpus {args.gpus}: this host has {torch.cuda.device_count()} visible GPU(s);"
                             " use fewer, or --device cpu for CPU ranks")
        if not on_cuda and (args.gpus or 2) > (os.cpu_count() or 1):
            # Allowed (memory and communication are still measured right), but said out loud.
            print(f"shardbench: note: {args.gpus or 2} CPU ranks on {os.cpu_count()} cores: ranks share cores,"
                  " so step times are not comparable to a run with a core per rank", file=sys.stderr)
        nnodes = args.nodes.nnodes if hasattr(args, "nodes") else 1  # `list`: one node
        if suite_files.is_suite_file(args.suite):
            # pytest and a resumed run must find the file wherever they are started from.
            args.suite = str(Path(args.suite).resolve())
        suites.cells_of(args.suite, world_size(args.gpus, nnodes), nnodes)
        if args.markexpr:
            markers.check_marker_expression(args.markexpr)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _pytest_args(args: argparse.Namespace) -> list[str]:
    out = [str(SUITES_DIR), "--suite", args.suite, "-p", "no:cacheprovider", "-o", "console_output_style=classic"]
    if args.gpus is not None:
        out += ["--gpus", str(args.gpus)]
    if args.markexpr:
        out += ["-m", args.markexpr]
    if args.keyword:
        out += ["-k", args.keyword]
    return out


def _resolve_nodes(args: argparse.Namespace) -> None:
    """--nnodes/--node-rank/--master-addr/--master-port, else SLURM's variables (README
    "Several nodes"), checked before anything launches; sets ``args.nodes``."""
    from harness.distributed import device_type
    from harness.runner import nodes

    try:
        args.nodes = nodes.resolve(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                                   master_port=args.master_port)
        # A resumed run keeps its own ranks per node (run.json), whatever the allocation offers.
        if args.nodes.multi and args.gpus is None and args.resume is None and (args.device or device_type()) == "cuda":
            args.gpus = nodes.slurm_ranks_per_node()  # a GPU node in a SLURM allocation
    except ValueError as error:
        raise UsageError(str(error)) from None


def _node_args(nodes) -> list[str]:
    if not nodes.multi:
        return []
    return ["--nnodes", str(nodes.nnodes), "--master-addr", nodes.master_addr, "--master-port", str(nodes.master_port),
            "--node-rank", str(nodes.node_rank)]


def _run_follower(args: argparse.Namespace) -> int:
    """A node of rank > 0: its ranks of the launches node 0 serves (its selection, or what its
    resumed run still lacks), nothing under results/ (runner/nodes.py)."""
    from harness.distributed import device_type
    from harness.results.provenance import harness_code_hash
    from harness.results.store import new_run_id
    from harness.runner import nodes
    from harness.runner.launcher import LaunchOptions

    wait_s = max(nodes.PLAN_WAIT_S, args.cell_timeout or 0)
    print(f"shardbench: node {args.nodes.node_rank}: waiting for node 0's plan at {args.nodes.master_addr}:"
          f"{args.nodes.plan_port} (up to {wait_s:.0f} s)", flush=True)
    try:
        plan = nodes.fetch_plan(args.nodes, harness_code_hash(), wait_s)
    except ValueError as error:
        print(f"shardbench: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    launch_dir = (args.out or REPO_ROOT).resolve() / "node-launches" / f"node{args.nodes.node_rank}-{new_run_id()}"
    # Node 0's limits, not this node's options: every rank of a launch must agree on them.
    options = LaunchOptions(cell_timeout_s=plan.cell_timeout_s, nodes=args.nodes, device_type=device_type(),
                            device_name=_device_name(), mem_cap_bytes=plan.mem_cap_bytes)
    return nodes.run_follower(plan, options, launch_dir)


def _resume_selection(args: argparse.Namespace) -> None:
    """--resume: the run's own selection (suite, -m, -k, world size, device) from its run.json;
    an option given that differs from it is refused, as is a run that cannot be found."""
    from harness.results.store import resolve_run
    from harness.runner import resume
    from harness.runner.session import world_size

    try:
        run_dir = resolve_run((args.out or REPO_ROOT) / "results", args.resume)
        original = resume.original_selection(run_dir)
        asked = {key: value for key, value in (("suite", args.suite), ("marker_expression", args.markexpr),
                                               ("keyword_expression", args.keyword), ("device", args.device),
                                               ("repeat", args.repeat))
                 if value is not None}
        asked["nnodes"] = args.nodes.nnodes
        if args.mem_cap_gib is not None:
            asked["mem_cap_bytes"] = int(args.mem_cap_gib * 2**30)
        if args.gpus is not None:
            asked["world_size"] = world_size(args.gpus, args.nodes.nnodes)
        resume.check_same_selection(run_dir, original, asked)
    except ValueError as error:
        raise UsageError(str(error)) from None
    args.resume = run_dir
    args.suite, args.markexpr, args.keyword = (original["suite"], original["marker_expression"],
                                               original["keyword_expression"])
    args.gpus = original["world_size"] // original["nnodes"]
    if original["mem_cap_bytes"] is not None:
        args.mem_cap_gib = original["mem_cap_bytes"] / 2**30
    if args.device is None and original["device"] in DEVICES:
        args.device = original["device"]
    if args.out is None:
        args.out = run_dir.parent.parent  # reports/ beside the results/ the run is in


def cmd_run(args: argparse.Namespace, extra: list[str]) -> int:
    from harness.runner import resume

    _resolve_nodes(args)
    if args.resume is not None and args.nodes.is_leader:  # the other nodes follow node 0's plan
        _resume_selection(args)
    elif args.retry_failed and args.resume is None:
        raise UsageError("--retry-failed: only with --resume RUN_ID")
    args.suite = "default" if args.suite is None else args.suite
    args.markexpr, args.keyword = args.markexpr or "", args.keyword or ""
    if args.nodes.is_leader:  # a follower runs node 0's selection, not its own
        _check_selection(args)
    else:
        _use_device(args)
    if args.out is not None:
        if args.out.exists() and not args.out.is_dir():
            raise UsageError(f"--out {args.out}: exists and is not a folder")
        args.out.mkdir(parents=True, exist_ok=True)
    _check_cell_timeout(args)
    _check_mem_cap(args)
    if args.repeat is not None and args.repeat < 1:
        raise UsageError(f"--repeat {args.repeat}: must be 1 or more trials per cell")
    if not args.nodes.is_leader:
        return _run_follower(args)
    pytest_args = _pytest_args(args) + _node_args(args.nodes) + ["-rfEs", *extra]
    if args.cell_timeout is not None:
        pytest_args += ["--cell-timeout", str(args.cell_timeout)]
    if args.mem_cap_bytes is not None:
        pytest_args += ["--mem-cap-bytes", str(args.mem_cap_bytes)]
    if args.repeat is not None:
        pytest_args += ["--repeat", str(args.repeat)]
    if args.memory_snapshot:
        pytest_args += ["--memory-snapshot"]
    if args.out is not None:
        pytest_args += ["--out", str(args.out.resolve())]
    if args.resume is not None:
        pytest_args += ["--resume", str(args.resume)] + (["--retry-failed"] if args.retry_failed else [])
    code = int(pytest.main(pytest_args))
    # Ended by SIGTERM / SIGINT: the shell's 128 + N, never 0 (the finished cells are kept).
    return 128 + resume.Interrupted.signum if resume.Interrupted.signum else code


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

    _check_selection(args)
    if args.suite in suites.BENCHMARK_SUITES:
        print(f"suite {args.suite} benchmarks the harness itself (suites/test_perf.py): run it with"
              f" ./run_all.sh --suite {args.suite}")
        return 0
    collector = _Collector()
    code = pytest.main(_pytest_args(args) + ["--collect-only", "-p", "no:terminal"],
                       plugins=[collector])
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
    from harness.results.store import resolve_run

    root = args.out or REPO_ROOT
    try:
        run_dir = resolve_run(root / "results", args.run)
    except ValueError as error:
        raise UsageError(str(error)) from None
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
    from harness.report import compare, compare_stats
    from harness.results.store import resolve_run

    root = args.out or REPO_ROOT
    try:
        compare_stats.parse_thresholds(args.fail_on)
        run_a, run_b = (resolve_run(root / "results", run) for run in (args.run_a, args.run_b))
    except ValueError as error:
        raise UsageError(str(error)) from None
    page = root / "reports" / "compare" / f"{run_a.name}_vs_{run_b.name}.html"
    code = compare.main_compare(run_a, run_b, fmt=args.format, fail_on=args.fail_on, html_out=page)
    print(f"\ncomparison page: {page}", file=sys.stderr)
    return code


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

        if args.seq is not None and args.seq != models_seq(args.model):
            traced = {"unavailable": f"the tracer runs the preset's sequence length ({models_seq(args.model)});"
                                     " drop --seq to trace"}
        else:
            cell = result["recommended"]["cell"]
            traced = tracer.trace_cells([cell])[cell.cell_id]
    if args.format == "json":
        print(plan.as_json(result, traced))
    else:
        print(plan.as_table(result, markdown=args.format == "markdown", traced=traced))
    return 0


def cmd_accuracy(args: argparse.Namespace, extra: list[str]) -> int:
    """Predicted ÷ measured for every measured cell of a run, and the worst per target."""
    from harness.predict import accuracy
    from harness.results.store import load_records, resolve_run

    root = args.out or REPO_ROOT
    try:
        run_dir = resolve_run(root / "results", args.run)
    except ValueError as error:
        raise UsageError(str(error)) from None
    text, all_met = accuracy.report(load_records(run_dir))
    print(text)
    return 0 if all_met or not args.strict else 1


def cmd_reproduce(args: argparse.Namespace, extra: list[str]) -> int:
    """Rerun one recorded cell from its record: bitwise-equal losses? how far did it move?"""
    from harness.distributed import DEVICE_ENV_VAR, device_type
    from harness.results.store import resolve_run
    from harness.runner import reproduce

    root = args.out or REPO_ROOT
    _check_cell_timeout(args)
    try:
        run_dir = resolve_run(root / "results", args.run)
        record = reproduce.find_record(run_dir, args.cell_id)
        recorded_device = reproduce.device_of(run_dir) or "cpu"
        os.environ[DEVICE_ENV_VAR] = recorded_device  # the workers run where the record was made
        device_type()  # refuses cuda on a host without a GPU
    except ValueError as error:
        raise UsageError(str(error)) from None
    text, reproduced = reproduce.reproduce(run_dir, record, recorded_device, args.cell_timeout)
    print(text)
    return 0 if reproduced else 1


def _check_cell_timeout(args: argparse.Namespace) -> None:
    if args.cell_timeout is not None and not args.cell_timeout > 0:
        raise UsageError(f"--cell-timeout {args.cell_timeout}: must be positive seconds")


def _device_name() -> str | None:
    import torch

    from harness.distributed import device_type

    return torch.cuda.get_device_name() if device_type() == "cuda" else None


def _check_mem_cap(args: argparse.Namespace) -> None:
    """--mem-cap-gib: positive, and on CUDA no more than the GPU has (sets args.mem_cap_bytes)."""
    import torch

    from harness.distributed import device_type

    args.mem_cap_bytes = None
    if args.mem_cap_gib is None:
        return
    if not args.mem_cap_gib > 0:
        raise UsageError(f"--mem-cap-gib {args.mem_cap_gib}: must be a positive number of GiB per rank")
    args.mem_cap_bytes = int(args.mem_cap_gib * 2**30)
    if device_type() == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if args.mem_cap_bytes > total:
            raise UsageError(f"--mem-cap-gib {args.mem_cap_gib}: more than the {total / 2**30:.1f} GiB"
                             f" of {torch.cuda.get_device_name(0)}; give at most that")


def models_seq(model: str) -> int | None:
    from harness import models

    return models.get_preset(model).seq_len


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="shardbench", description="Distributed training strategies, side by side.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a suite (extra arguments go to pytest)")
    _selection_args(run)
    run.add_argument("--out", type=Path, default=None, help="folder for results/ and reports/ (default: the repo)")
    run.add_argument("--cell-timeout", type=float, default=None,
                     help="seconds without progress before a cell is declared hung (default: scaled to each"
                          " cell, README Faults)")
    run.add_argument("--mem-cap-gib", type=float, default=None,
                     help="memory per rank, as if each had a device this size: a rank over it records oom"
                          " with its peak (README Faults)")
    run.add_argument("--repeat", type=int, default=None,
                     help="trials per cell, in rounds over every cell (default 1; with --resume: the run's own;"
                          " README Repeated runs)")
    run.add_argument("--memory-snapshot", action="store_true",
                     help="write each cell's memory-over-time by category (and on CUDA the allocator's snapshot"
                          " for pytorch.org/memory_viz) to the run folder's memory/; charted in the cell's page")
    run.add_argument("--nnodes", type=int, default=None,
                     help="nodes in the job, one launcher per node (default 1, or SLURM_NNODES); README Several nodes")
    run.add_argument("--node-rank", type=int, default=None, help="this node's rank in [0, nnodes) (or SLURM_NODEID);"
                     " only node 0 writes results/")
    run.add_argument("--master-addr", default=None,
                     help="node 0's address, the c10d rendezvous endpoint (or SLURM_JOB_NODELIST's first host)")
    run.add_argument("--master-port", type=int, default=None,
                     help="the rendezvous endpoint's port (default MASTER_PORT, else 29500)")
    run.add_argument("--resume", default=None, metavar="RUN_ID",
                     help="run the cells of run RUN_ID (id under results/, 'latest', or a run folder) that have"
                          " no record yet, into the same run; the selection is the run's own")
    run.add_argument("--retry-failed", action="store_true",
                     help="with --resume: also re-run cells recorded failed, timeout or oom")
    run.set_defaults(suite=None, markexpr=None, keyword=None)  # None: not given (a resume takes the run's)
    run.set_defaults(func=cmd_run)
    lst = sub.add_parser("list", help="show the cells a selection runs, without running them")
    _selection_args(lst)
    lst.set_defaults(func=cmd_list)
    rep = sub.add_parser("report", help="rebuild a run's HTML report from its results")
    rep.add_argument("run", help="run id under results/ (or 'latest'), or a run folder")
    rep.add_argument("--out", type=Path, default=None, help="folder holding results/ and reports/")
    rep.set_defaults(func=cmd_report)
    pub = sub.add_parser("publish", help="copy reports/ into a folder ready for static hosting")
    pub.add_argument("destination", type=Path, help="a new (or empty) folder")
    pub.add_argument("--out", type=Path, default=None, help="folder holding results/ and reports/")
    pub.set_defaults(func=cmd_publish)
    cmp_ = sub.add_parser("compare", help="compare run B with baseline run A, cell by cell")
    cmp_.add_argument("run_a", help="baseline: run id under results/ (or 'latest'), or a run folder")
    cmp_.add_argument("run_b", help="candidate: run id under results/ (or 'latest'), or a run folder")
    cmp_.add_argument("--format", choices=("text", "markdown", "html"), default="text")
    cmp_.add_argument("--fail-on", default=None, metavar="SPEC",
                      help="exit 1 on regressions beyond e.g. mem:5%%,time:10%%,throughput:10%%"
                           " (a change counts only once marked worse: time/throughput beyond 10%%, memory 0.5%%)")
    cmp_.add_argument("--out", type=Path, default=None, help="folder holding results/ and reports/")
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
    rpr.add_argument("run", help="run id under results/ (or 'latest'), or a run folder")
    rpr.add_argument("cell_id", help="the cell's id, as in the record")
    rpr.add_argument("--cell-timeout", type=float, default=None,
                     help="seconds without progress before the cell is declared hung (default: scaled to the cell)")
    rpr.add_argument("--out", type=Path, default=None, help="folder holding results/ and reports/")
    rpr.set_defaults(func=cmd_reproduce)
    acc = sub.add_parser("accuracy", help="predicted vs measured memory and communication of a run's cells")
    acc.add_argument("run", nargs="?", default="latest", help="run id under results/ (default: latest), or a run folder")
    acc.add_argument("--strict", action="store_true", help="exit 1 when any cell misses a ±10%% target")
    acc.add_argument("--out", type=Path, default=None, help="folder holding results/ and reports/")
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
