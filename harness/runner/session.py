"""One benchmark run inside a pytest session: where results go, the run's environment
record, the MatrixRun over the selected cells, and the closing summary and report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from harness import distributed
from harness.measure import environment
from harness.report import history, html
from harness.results.store import RunStore, new_run_id
from harness.runner.launcher import LaunchOptions
from harness.runner.matrix import MatrixRun, human_bytes

REPO_ROOT = Path(__file__).resolve().parents[2]
SELECTED = pytest.StashKey[list]()
_RUN = pytest.StashKey["MatrixRun"]()


def world_size(gpus: int | None) -> int:
    """Ranks per node (one node in this release): every GPU, or 2 CPU processes."""
    if gpus is not None:
        return gpus
    return torch.cuda.device_count() if distributed.device_type() == "cuda" else 2


def selected_cells(items: list[pytest.Item]) -> list:
    """The cells behind collected test items (matrix tests are parametrised by ``cell``)."""
    return [item.callspec.params["cell"] for item in items
            if hasattr(item, "callspec") and "cell" in item.callspec.params]


def out_dir(config: pytest.Config) -> Path:
    return (config.getoption("out") or REPO_ROOT).resolve()


def start(config: pytest.Config) -> MatrixRun:
    cells = config.stash.get(SELECTED, [])
    root = out_dir(config)
    store = RunStore(root / "results", new_run_id())
    device_type = distributed.device_type()
    device_name = torch.cuda.get_device_name() if device_type == "cuda" else None
    store.write_run_info({
        "run_id": store.run_id,
        "suite": config.getoption("suite"),
        "command": sys.argv,
        "marker_expression": config.getoption("markexpr") or "",
        "keyword_expression": config.getoption("keyword") or "",
        "world_size": world_size(config.getoption("gpus")),
        "device": {"type": device_type, "name": device_name},
        "environment": environment.collect(REPO_ROOT),
    })
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def progress(line: str) -> None:
        # The matrix runs inside a fixture, where pytest captures output: lift it per line.
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)

    progress(f"shardbench: {len(cells)} cells selected; results in {store.path}")
    run = MatrixRun(cells, store, LaunchOptions(cell_timeout_s=config.getoption("cell_timeout")),
                    device_type=device_type, device_name=device_name, progress=progress)
    config.stash[_RUN] = run
    run.run()
    return run


def summarize(config: pytest.Config, reporter) -> None:
    run = config.stash.get(_RUN, None)
    if run is None:
        return
    reporter.section("shardbench summary")
    reporter.write_line(f"{'cell':<60} {'status':<11} {'peak/rank':>11} {'step':>9} {'tokens/s':>10} {'equivalent':>10}")
    for record in run.records.values():
        m, eq = record["metrics"], record["equivalence"]
        verdict = "reference" if eq is None and record["status"] == "ok" else (
            "-" if eq is None else "yes" if eq["passed"] else "NO")
        step = f"{m['step_time_s'] * 1e3:.1f} ms" if m else "-"
        tokens = f"{m['tokens_per_s']:.0f}" if m else "-"
        reporter.write_line(f"{record['cell_id']:<60} {record['status']:<11} {human_bytes(m.get('peak_mem_bytes')):>11}"
                            f" {step:>9} {tokens:>10} {verdict:>10}")
    reports = out_dir(config) / "reports"
    report = html.write_run_report(run.store.path, reports / run.store.run_id)
    history.write_index(run.store.path.parent, reports)
    reporter.write_line(f"results: {run.store.path}")
    reporter.write_line(f"report:  {report}")
