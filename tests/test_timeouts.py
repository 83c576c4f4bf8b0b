"""The default per-cell timeout scales with the cell; --cell-timeout replaces it; the
launcher ends a hung cell at its own limit."""

import dataclasses

import pytest

from harness import faults
from harness.config import CellSpec, StrategySpec
from harness.runner import timeouts
from harness.runner.launcher import LaunchOptions, run_batch

CELL = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"))


def _compute_part(cell: CellSpec, **where) -> float:
    return timeouts.for_cell(cell, None, **({"device_type": "cpu", "device_name": None} | where)).seconds \
        - timeouts.START_UP_S


def test_the_limit_grows_with_steps_model_size_and_batch():
    base = _compute_part(CELL)
    assert base > 0
    assert _compute_part(dataclasses.replace(CELL, steps=40)) == pytest.approx(4 * base)
    assert _compute_part(dataclasses.replace(CELL, micro_batch=8)) == pytest.approx(4 * base)
    big = dataclasses.replace(CELL, model="llama3-8b", micro_batch=1)
    assert _compute_part(big) > 1000 * base


def test_the_precision_rate_is_measured_per_precision():
    bf16 = dataclasses.replace(CELL, strategy=StrategySpec(name="ddp", precision="bf16"))
    rate = timeouts.cpu_flops_per_s("bf16")
    assert _compute_part(bf16) == pytest.approx(timeouts.SAFETY * timeouts.expected_compute_s(bf16, rate))


def test_a_given_timeout_wins_and_an_unknown_gpu_is_not_guessed():
    assert timeouts.for_cell(CELL, 42.0, "cpu", None).seconds == 42.0
    unknown = timeouts.for_cell(CELL, None, "cuda", "Some Future GPU")
    assert unknown.seconds == timeouts.FALLBACK_S and "no FLOP rate known for Some Future GPU" in unknown.why
    h200 = timeouts.for_cell(CELL, None, "cuda", "NVIDIA H200")
    assert timeouts.START_UP_S < h200.seconds < timeouts.START_UP_S + 1  # a tiny model at a GPU's peak


def test_the_launcher_ends_a_hung_cell_at_its_scaled_limit(tmp_path, monkeypatch):
    hanging = CellSpec(model="mlp-tiny", strategy=StrategySpec(name="ddp"))
    monkeypatch.setenv(faults.ENV_VAR, f"{hanging.cell_id}=hang")
    # The scaled default, shortened for a test: the launch takes about 6 s to report the cell's
    # start, and whether the limit falls before or after it, the cell is the one timed out.
    monkeypatch.setattr(timeouts, "START_UP_S", 10.0)
    outcomes: list = []
    run_batch([hanging], LaunchOptions(), tmp_path, outcomes.append)
    (outcome,) = outcomes
    assert outcome.status == "timeout"
    assert "no result after 10 s (the limit: 10 s start-up + 20 × " in outcome.reason
