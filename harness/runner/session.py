"""One benchmark run inside a pytest session: where results go, the run's environment
record, the MatrixRun over the selected cells, and the closing summary and report."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest
import torch

from harness import distributed, suite_files, suites_gpu
from harness.config import CellSpec, RunOptions, gib_of
from harness.measure import environment
from harness.report import history, html
from harness.results import provenance
from harness.results.store import ResultsNotWritable, RunStore, load_run_info, new_run_id
from harness.runner import nodes, resume
from harness.runner.launcher import BANDWIDTH_TIMEOUT_S, LaunchOptions, nodes_of, run_bandwidth_sweep
from harness.runner.matrix import MatrixRun, human_bytes
from harness.runner.node_spec import NodeSpec
from harness.runner.nodes import Plan, PlanServer, sweep_rdzv_id

REPO_ROOT = Path(__file__).resolve().parents[2]
SELECTED = pytest.StashKey[list]()
# The bandwidth sweep is seconds on either device; a launch that takes longer is stuck.
# --memory-snapshot: the run folder's sub-folder of memory timelines (runner/worker.py).
MEMORY_SNAPSHOT_DIR = "memory"
PROFILE_DIR = "profiles"
_RUN = pytest.StashKey["MatrixRun"]()
# The report written (its path, what it skipped), or why it could not be.
_REPORT = pytest.StashKey["tuple[Path, list[str]] | str"]()
# A run that could not write its results or report: sysexits' EX_IOERR.
EXIT_NOT_WRITTEN = 74
_PLAN_SERVER = pytest.StashKey[PlanServer]()


def run_options(config: pytest.Config) -> RunOptions:
    """The run's options, as given to pytest (ValueError, one line, for a bad one)."""
    return RunOptions.from_args(config.option, "pytest")


def node_spec(config: pytest.Config) -> NodeSpec:
    """This launcher's place in a multi-node job (runner/node_spec.py), from the pytest options:
    no SLURM variables (``python -m harness run`` resolves those and passes the result)."""
    return nodes.of_options(run_options(config), environ={})


def selected_cells(items: list[pytest.Item]) -> list:
    """The cells behind collected test items (matrix tests are parametrised by ``cell``)."""
    return [item.callspec.params["cell"] for item in items
            if hasattr(item, "callspec") and "cell" in item.callspec.params]


def out_dir(config: pytest.Config) -> Path:
    return (run_options(config).out or REPO_ROOT).resolve()


def fit_memory_bytes(options: RunOptions) -> int | None:
    """The memory per rank cells are predicted against before launch: on CUDA the GPU's
    (or --gpu-mem), never more than --mem-cap-gib. None on the CPU, whose ranks share the
    host's memory: there a cell is launched and an over-large one records oom."""
    gpu = suites_gpu.target(options.gpu_mem_bytes)
    if gpu is None:
        return None
    return min(gpu.memory_bytes, options.mem_cap_bytes or gpu.memory_bytes)


def engines_to_calibrate(cells: list[CellSpec]) -> tuple[str, ...]:
    """The strategies of the distributed cells, each of whose steps a CPU run's calibration
    launch times (harness/calibration.py; the step-time predictor adds an engine's overhead on
    the CPU only)."""
    return tuple(sorted({c.strategy.name for c in cells if c.world_size > 1}))


def start(config: pytest.Config) -> MatrixRun:
    cells = config.stash.get(SELECTED, [])
    options = run_options(config)
    root = out_dir(config)
    resume.Interrupted.install()
    device_type = distributed.device_type()
    device_name = torch.cuda.get_device_name() if device_type == "cuda" else None
    recorded = None
    if options.resume is not None:  # same run folder, same run.json (plus a resume event)
        resume_dir = Path(options.resume)
        store = RunStore(resume_dir.parent, resume_dir.name)
        original = resume.original_selection(resume_dir)  # the run's own; a different one was refused
        options = dataclasses.replace(options, repeat=original["repeat"],
                                      mem_cap_gib=gib_of(original["mem_cap_bytes"]), gpu_mem=original["gpu_mem"])
        recorded = resume.begin(store, command=sys.argv, retry_failed=options.retry_failed)
        run_info = load_run_info(resume_dir)
    else:
        store = RunStore(root / "results", new_run_id())
        suite = options.suite
        ranks_per_node = distributed.job_world_size(options.gpus)
        environment_info = environment.collect(REPO_ROOT)
        # This node's ranks only: the one launch that needs no other node to take part.
        environment_info["bandwidth"] = {"skipped": "--no-bandwidth"} if options.no_bandwidth else {
            "scope": f"{ranks_per_node} rank(s) of one node",
            **run_bandwidth_sweep(ranks_per_node, store.path / "launches" / "bandwidth", BANDWIDTH_TIMEOUT_S,
                                  engines=engines_to_calibrate(cells) if device_type == "cpu" else ()),
        }
        run_info = {
            "run_id": store.run_id,
            "suite": suite,
            # A suite file's text too: the file may change or vanish after the run.
            **({"suite_file": Path(suite).read_text()} if suite_files.is_suite_file(suite) else {}),
            "command": sys.argv,
            "marker_expression": options.marker_expression,
            "keyword_expression": options.keyword_expression,
            "world_size": distributed.job_world_size(options.gpus, node_spec(config).nnodes),
            "repeat": options.repeat or 1,
            "mem_cap_bytes": options.mem_cap_bytes,
            "gpu_mem": options.gpu_mem,
            "nodes": node_spec(config).to_dict(),
            "device": {"type": device_type, "name": device_name},
            "environment": environment_info,
        }
        store.write_run_info(run_info)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        raise RuntimeError("shardbench's progress lines need pytest's terminal reporter and capture plugins")

    def progress(line: str) -> None:
        # The matrix runs inside a fixture, where pytest captures output: lift it per line.
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)

    repeat = options.repeat or 1
    progress(f"shardbench: {len(cells)} cells selected" + (f", {repeat} trials each in rounds" if repeat > 1 else "")
             + f"; results in {store.path}")
    launch = LaunchOptions(run=options, nodes=node_spec(config), device_type=device_type, device_name=device_name,
                           memory_snapshot_dir=store.path / MEMORY_SNAPSHOT_DIR if options.memory_snapshot else None,
                           profile_dir=store.path / PROFILE_DIR if options.profile else None,
                           follower_refusal=follower_refusal(config))
    run = MatrixRun(cells, store, launch,
                    device_type=device_type, device_name=device_name, progress=progress, repeat=repeat,
                    recorded=recorded, fit_memory_bytes=fit_memory_bytes(options), launch_anyway=options.launch_anyway,
                    calibration=step_time_rates(run_info["environment"]))
    config.stash[_RUN] = run
    if launch.nodes.multi:
        spanning = [[c for c in cells if nodes_of(c.world_size, launch.nodes) > 1] for cells in run.launch_rounds()]
        # Every node's ranks sweep together before the cells (not on a resume: its run has one).
        sweep_ranks = (None if options.no_bandwidth or recorded is not None
                       else distributed.job_world_size(options.gpus, launch.nodes.nnodes))
        publish_plan(config, Plan(run_id=store.run_id, rounds=spanning, cell_timeout_s=options.cell_timeout_s,
                                  mem_cap_bytes=options.mem_cap_bytes, sweep_world_size=sweep_ranks))
        if sweep_ranks is not None:
            progress(f"shardbench: bandwidth sweep across {launch.nodes.nnodes} nodes ({sweep_ranks} ranks)")
            run_info["environment"]["bandwidth_across_nodes"] = {
                "scope": f"{sweep_ranks} rank(s) on {launch.nodes.nnodes} nodes",
                **run_bandwidth_sweep(sweep_ranks, store.path / "launches" / "bandwidth-across-nodes",
                                      BANDWIDTH_TIMEOUT_S, launch.nodes, sweep_rdzv_id(store.run_id))}
            store.write_run_info(run_info)
            run.calibration = step_time_rates(run_info["environment"])
    run.run()
    return run


def step_time_rates(environment: dict) -> dict | None:
    """What the run's cells' steps are priced at (predict/step_time.py): its calibration, with
    its sweep across nodes where it ran one (over several nodes; a resume reads it back)."""
    calibration, across = environment.get("bandwidth"), environment.get("bandwidth_across_nodes")
    if calibration and across and across.get("rows"):
        return {**calibration, "across_nodes": across}
    return calibration


def open_plan_server(config: pytest.Config) -> None:
    """Node 0 of several: bind the plan port now (runner/nodes.py), before anything runs."""
    if node_spec(config).multi:
        config.stash[_PLAN_SERVER] = PlanServer(node_spec(config))


def follower_refusal(config: pytest.Config) -> Callable[[], str | None]:
    """Why a follower node refused node 0's plan, once one has (runner/nodes.py); a single
    node has no followers."""
    server = config.stash.get(_PLAN_SERVER, None)
    return server.refusal if server is not None else lambda: None


def publish_plan(config: pytest.Config, plan: Plan) -> None:
    config.stash[_PLAN_SERVER].publish(plan, provenance.harness_code_hash())


def close_plan_server(config: pytest.Config) -> None:
    server = config.stash.get(_PLAN_SERVER, None)
    if server is not None:
        server.close()


def trials_columns(trials: dict) -> str:
    """With --repeat: the cell's trials, their step-time spread, and how far its peak memory
    moved across them ("same": identical)."""
    moved = trials["peak_mem_range_bytes"]
    spread = "-" if trials["spread"] is None else f"{trials['spread']:.1%}"
    return f" {trials['n']:>6} {spread:>7} {'-' if moved is None else 'same' if moved == 0 else human_bytes(moved):>10}"


def summarize(config: pytest.Config, reporter) -> None:
    run = config.stash.get(_RUN, None)
    if run is None:
        return
    reporter.section("shardbench summary")
    # With --repeat N: medians over each cell's trials, and their spread (harness/results/trials.py).
    trials_head = f" {'trials':>6} {'spread':>7} {'peak moved':>10}" if run.repeat > 1 else ""
    reporter.write_line(f"{'cell':<60} {'status':<11} {'peak/rank':>11} {'step':>9} {'tokens/s':>10} {'equivalent':>10}"
                        + trials_head)
    for record in run.records.values():
        m, eq = record["metrics"], record["equivalence"]
        verdict = "reference" if eq is None and record["status"] == "ok" else (
            "-" if eq is None else "ungated" if eq["passed"] is None else "yes" if eq["passed"] else "NO")
        # An oom's metrics hold only the peak it reached.
        step = f"{m['step_time_s'] * 1e3:.1f} ms" if m.get("step_time_s") else "-"
        tokens = f"{m['tokens_per_s']:.0f}" if m.get("tokens_per_s") else "-"
        line = (f"{record['cell_id']:<60} {record['status']:<11} {human_bytes(m.get('peak_mem_bytes')):>11}"
                f" {step:>9} {tokens:>10} {verdict:>10}")
        reporter.write_line(line + (trials_columns(record["trials"]) if run.repeat > 1 else ""))
    reporter.write_line(f"results: {run.store.path}")
    if not run.complete:
        # Interrupted: end promptly; the resumed run builds the report.
        reporter.write_line(f"interrupted: {run.recorded_count()} recorded;"
                            f" {_resume_command(config, run.store.run_id)}")
        return
    written = config.stash.get(_REPORT, None)
    if isinstance(written, str):
        reporter.write_line(f"report:  not written: {written}")
        return
    if written is not None:
        report, skipped = written
        if skipped:
            reporter.write_line(f"skipped {len(skipped)} unreadable item(s) of {run.store.path}"
                                " (warnings above, and in the report)")
        reporter.write_line(f"report:  {report}")


def write_report(session: pytest.Session) -> None:
    """A complete run's HTML report and the reports' index (pytest_sessionfinish, before the
    summary prints where it went). A report that cannot be written (disk full, read-only) is
    one line there and the run's exit status EXIT_NOT_WRITTEN; the results stay complete."""
    config = session.config
    run = config.stash.get(_RUN, None)
    if run is None or not run.complete:
        return
    reports = out_dir(config) / "reports"
    skipped: list[str] = []
    try:
        report = html.write_run_report(run.store.path, reports / run.store.run_id, skipped)
        history.write_index(run.store.path.parent, reports)
    except OSError as error:
        config.stash[_REPORT] = (f"{error.filename or reports}: {error.strerror or error}; the results are complete:"
                                 f" free space, then `python -m harness report {run.store.run_id}{_out_flag(config)}`"
                                 " builds it")
        session.exitstatus = EXIT_NOT_WRITTEN
        return
    config.stash[_REPORT] = (report, skipped)


def stop_unwritable(config: pytest.Config, error: ResultsNotWritable) -> NoReturn:
    """End the session at a results file it cannot write: one line saying what was recorded
    and the command that completes the run (pytest prints no summary after such an exit)."""
    run = config.stash.get(_RUN, None)
    recorded = "" if run is None else f": {run.recorded_count()} recorded; {_resume_command(config, run.store.run_id)}"
    pytest.exit(f"shardbench: error: {error}{recorded}", returncode=EXIT_NOT_WRITTEN)


def _resume_command(config: pytest.Config, run_id: str) -> str:
    return f"run the rest with ./run_all.sh --resume {run_id}{_out_flag(config)}"


def _out_flag(config: pytest.Config) -> str:
    """`` --out DIR`` where the run was given one: commands printed for the user to run next."""
    return f" --out {out_dir(config)}" if run_options(config).out else ""
