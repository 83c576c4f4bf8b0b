"""``--repeat N`` end to end: one cell and its reference, twice, through pytest and the real
launcher (2 gloo ranks): rounds interleaved, every trial recorded, fp32 peaks identical
across trials, medians and spread in the summary and the report; then a resume that runs only
the missing (cell, trial)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from harness.predict import accuracy
from harness.report import html
from harness.results.store import load_records
from harness.runner.matrix import launch_dir_name

REPO = Path(__file__).resolve().parents[1]
CELL = "gpt2-tiny/ddp/fp32/ckpt_none/mb2/ws2/seed0"
REFERENCE = "gpt2-tiny/single/fp32/ckpt_none/mb4/ws1/seed0"


def suite(*args: str) -> subprocess.CompletedProcess:
    # The trace and the bandwidth sweep are not what is tested: skipped, to reach the cells sooner.
    return subprocess.run([sys.executable, "-m", "pytest", "suites", "--suite", "smoke", "-p", "no:cacheprovider",
                           "--no-trace", "--no-bandwidth", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SHARDBENCH_DEVICE": "cpu"})


def order(run_dir: Path) -> list[tuple[str, int]]:
    return [(r["cell_id"], r["trial"]) for r in map(json.loads, (run_dir / "cells.jsonl").read_text().splitlines())]


def test_repeat_runs_interleaved_rounds_records_every_trial_and_resumes_the_missing_one(tmp_path):
    run = suite("-k", CELL, "--repeat", "2", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run_dir = (tmp_path / "results" / "latest").resolve()
    assert json.loads((run_dir / "run.json").read_text())["repeat"] == 2
    # Rounds: the reference first, then the cell, in each; every trial 0 before any trial 1.
    assert order(run_dir) == [(REFERENCE, 0), (CELL, 0), (REFERENCE, 1), (CELL, 1)]
    # One launch per world size and round (and no bandwidth sweep: --no-bandwidth).
    assert {p.name for p in (run_dir / "launches").iterdir()} == {
        launch_dir_name(ws, trial) for ws in (1, 2) for trial in (0, 1)}
    assert json.loads((run_dir / "run.json").read_text())["environment"]["bandwidth"] == {"skipped": "--no-bandwidth"}
    records = load_records(run_dir)
    assert all(r["predicted"]["traced"] == {"unavailable": "not traced: --no-trace"} for r in records)
    for cell_id in (REFERENCE, CELL):
        trials = [r for r in records if r["cell_id"] == cell_id]
        assert [r["status"] for r in trials] == ["ok", "ok"]
        # fp32 tensor bytes on the CPU: the same on every trial, rank by rank.
        assert trials[0]["metrics"]["peak_mem_bytes"] == trials[1]["metrics"]["peak_mem_bytes"]
        assert ([p["peak_mem_bytes"] for p in trials[0]["per_rank"]]
                == [p["peak_mem_bytes"] for p in trials[1]["per_rank"]])
        assert trials[0]["losses"] == trials[1]["losses"]
    gated = [r["equivalence"] for r in records if r["cell_id"] == CELL]
    assert all(eq["passed"] and eq["max_rel_loss_diff"] is not None for eq in gated)

    summary = run.stdout[run.stdout.index("shardbench summary"):]
    assert "trials  spread peak moved" in summary
    assert [line.split()[-3::2] for line in summary.splitlines() if line.startswith(CELL)] == [["2", "same"]]
    assert "[  4/4 t1] ok" in run.stdout  # the progress line names the trial
    page = (tmp_path / "reports" / run_dir.name / "index.html").read_text()
    assert "trials · spread · peak" in page and page.count("2 · ") == 2 and page.count("· same<") == 2
    cell_page = (tmp_path / "reports" / run_dir.name / "cells" / html.cell_page_name(CELL)).read_text()
    assert 'id="trials-table"' in cell_page and " (shown)" in cell_page
    text, _ = accuracy.report(records)
    assert [line.split()[0] for line in text.splitlines()[1:3]] == [REFERENCE, CELL]  # one line per cell

    # A resume with another --repeat is refused (test_resume.py); one without runs the missing trial.
    lines = (run_dir / "cells.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "cells.jsonl").write_text("".join(lines[:-1]))  # as if killed before the cell's trial 1 ended
    # pytest used directly needs the run's own -k to select its cells (python -m harness reads it from run.json).
    resumed = suite("--resume", str(run_dir), "-k", CELL, "--out", str(tmp_path))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming: 3 of 4 cell trials recorded and kept, 1 to run" in resumed.stdout
    assert order(run_dir) == [(REFERENCE, 0), (CELL, 0), (REFERENCE, 1), (CELL, 1)]


def test_repeat_below_1_is_refused_before_anything_runs(tmp_path):
    refused = suite("--repeat", "0", "--out", str(tmp_path))
    assert refused.returncode == 4 and "--repeat 0: must be 1 or more" in refused.stderr
    assert not (tmp_path / "results").exists()
