"""The default per-cell timeout scales with the cell; --cell-timeout replaces it. The
launcher ending a hung cell at its scaled limit is checked in tests/test_runs.py, in the
batch that also checks isolation (one hang, one launch, for both)."""

import dataclasses

import pytest

from harness.config import CellSpec, StrategySpec
from harness.runner import timeouts

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
