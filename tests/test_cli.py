"""The commands a user types: bad input is refused before anything runs; the smoke suite
runs end to end through pytest and leaves results, a summary and a report."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shardbench(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--suite", "nightly"], "unknown suite 'nightly': choose one of smoke, default, full, perf"),
        (["run", "-m", "zero4 and bf16"], "unknown marker(s) zero4 in -m 'zero4 and bf16': choose from"),
        (["run", "--gpus", "0"], "--gpus 0: must be a positive number"),
        (["run", "--gpus", "1"], "--gpus 1: the suites compare strategies across ranks; use 2 or more"),
        (["run", "--cell-timeout", "-5"], "--cell-timeout -5.0: must be positive"),
        (["list", "-m", "fsdp3"], "unknown marker(s) fsdp3"),
        (["report", "no-such-run"], "no run at"),
        (["compare", "run-a", "run-b", "--fail-on", "cpu:5%"], "--fail-on='cpu:5%': expected comma-separated KEY:N%"),
        (["compare", "run-a", "run-b"], "no run at"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_with_nothing_launched(tmp_path, args, message):
    result = shardbench(*args, "--out", str(tmp_path)) if args[0] != "list" else shardbench(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "results").exists()


def test_list_shows_the_selection_and_the_references_it_needs():
    result = shardbench("list", "-m", "fsdp and bf16")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "2 cells selected, 2 references added"
    assert all("bf16" in line for line in lines[:-1])


def test_smoke_suite_end_to_end(tmp_path):
    result = shardbench("run", "--suite", "smoke", "--out", str(tmp_path))
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "[  1/6]" in out and "[  6/6]" in out  # a progress line per cell, the added reference included
    assert "shardbench summary" in out
    run_dir = (tmp_path / "results" / "latest").resolve()
    info = json.loads((run_dir / "run.json").read_text())
    assert info["suite"] == "smoke" and info["environment"]["versions"]["torch"]
    records = [json.loads(line) for line in (run_dir / "cells.jsonl").read_text().splitlines()]
    assert len(records) == 6
    statuses = {r["cell_id"]: r["status"] for r in records}
    assert statuses["gpt2-tiny/ddp/fp32/ckpt_none/compress_bf16/mb2/ws2/seed0"] == "unsupported"
    assert sum(s == "ok" for s in statuses.values()) == 5
    report = tmp_path / "reports" / run_dir.name / "index.html"
    html = report.read_text()
    assert all(r["cell_id"] in html for r in records)
    rebuilt = shardbench("report", "latest", "--out", str(tmp_path))
    assert rebuilt.returncode == 0 and rebuilt.stdout.strip() == str(report)
