"""A recorded cell reruns from its record alone: fp32 on the CPU bitwise, and the record says
which config and which harness code produced it."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.config import CellSpec, StrategySpec
from harness.results import provenance
from harness.results.schema import make_record
from harness.runner import reproduce

REPO = Path(__file__).resolve().parents[1]
CELL = "gpt2-tiny/ddp/fp32/ckpt_none/mb2/ws2/seed0"


def shardbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def test_config_hash_follows_every_field_and_nothing_else():
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"))
    same = CellSpec.from_dict(json.loads(json.dumps(cell.to_dict())))
    assert provenance.config_hash(cell) == provenance.config_hash(same)
    assert provenance.config_hash(cell) != provenance.config_hash(dataclasses.replace(cell, seed=1))
    assert provenance.config_hash(cell) != provenance.config_hash(
        dataclasses.replace(cell, strategy=StrategySpec(name="ddp", precision="bf16")))


def test_harness_code_hash_changes_with_the_code(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("not code")
    monkeypatch.setattr(provenance, "HARNESS_DIR", tmp_path)
    provenance.harness_code_hash.cache_clear()
    before = provenance.harness_code_hash()
    (tmp_path / "notes.txt").write_text("still not code")
    provenance.harness_code_hash.cache_clear()
    assert provenance.harness_code_hash() == before
    (tmp_path / "a.py").write_text("x = 2\n")
    provenance.harness_code_hash.cache_clear()
    assert provenance.harness_code_hash() != before
    provenance.harness_code_hash.cache_clear()


def test_a_recorded_cell_reproduces_bitwise(smoke_run, capsys):
    tmp_path, run = smoke_run  # the smoke suite's run (tests/conftest.py), CELL among its cells
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    run_dir = (tmp_path / "results" / "latest").resolve()
    record = next(json.loads(line) for line in (run_dir / "cells.jsonl").read_text().splitlines()
                  if json.loads(line)["cell_id"] == CELL)
    assert record["provenance"]["cell_version"] and record["provenance"]["seed"] == 0

    again = shardbench("reproduce", "latest", CELL, "--out", str(tmp_path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "losses: bitwise equal" in again.stdout
    assert f"cell version {record['provenance']['cell_version']}: same config, same harness code" in again.stdout
    assert "peak memory per rank" in again.stdout and "(+0.0%)" in again.stdout
    assert list((run_dir / "reproduce").iterdir())  # the rerun's launch logs, beside the run

    assert cli.main(["reproduce", "latest", "gpt2-tiny/nope", "--out", str(tmp_path)]) == 2
    assert "no cell 'gpt2-tiny/nope'" in capsys.readouterr().err


def test_find_record_gives_the_median_of_the_trials_and_names_a_trial_that_failed(tmp_path):
    ok, flaky = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp")), CellSpec(
        model="gpt2-tiny", strategy=StrategySpec(name="zero1"))
    lines = []
    for trial, step in enumerate((0.3, 0.1, 0.2)):
        lines.append(make_record(ok, markers=[], status="ok", metrics={"step_time_s": step}, trial=trial))
        lines.append(make_record(flaky, markers=[], status="failed" if trial == 1 else "ok", reason="boom",
                                 trial=trial))
    (tmp_path / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    record = reproduce.find_record(tmp_path, ok.cell_id)
    assert record["metrics"]["step_time_s"] == 0.2 and record["trial"] == 2 and record["trials"]["n"] == 3
    with pytest.raises(ValueError, match=r"ended 'failed' \(trial 1 of 3\) in run"):
        reproduce.find_record(tmp_path, flaky.cell_id)
