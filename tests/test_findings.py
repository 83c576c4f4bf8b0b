"""The run page's findings (harness/report/findings.py) from synthetic records: pairs are the
cells that differ in one axis alone, effects are ratios against the stated baseline, the
predicted effect sits beside the measured one, and pairs that disagree are said to."""

from __future__ import annotations

import pytest

from harness import markers as cell_markers
from harness.config import CellSpec, StrategySpec
from harness.report import findings
from harness.results.schema import make_record


def _record(model: str = "gpt2-tiny", status: str = "ok", *, peak: float, step: float, comm: float = 1e6,
            predicted_peak: float | None = None, **strategy) -> dict:
    cell = CellSpec(model=model, strategy=StrategySpec(**{"name": "ddp", **strategy}))
    return make_record(
        cell, markers=cell_markers.markers_of(cell), status=status,
        metrics={"peak_mem_bytes": peak, "step_time_s": step, "tokens_per_s": 64 / step,
                 "comm_bytes_per_step": comm} if status == "ok" else None,
        predicted={"analytic": {"peak_bytes": predicted_peak or peak, "comm_bytes_per_step": comm},
                   "step_time_s": step})


def _by_value(records: list[dict], axis_key: str) -> dict[str, findings.Finding]:
    (axis,) = [a for a in findings.AXES if a.key == axis_key]
    return {f.value: f for f in findings.axis_findings(records, axis)}


def test_a_pair_differs_in_the_axis_alone_and_its_effect_is_the_ratio_to_the_baseline():
    records = [
        _record(peak=100, step=0.010),
        _record(name="fsdp_full", peak=60, step=0.030, comm=1.5e6, predicted_peak=58),
        # bf16 differs from the ddp cell in precision alone; from fsdp_full in two axes: no pair there.
        _record(precision="bf16", peak=80, step=0.010),
    ]
    strategy = _by_value(records, "strategy")
    assert list(strategy) == ["fsdp_full"]
    zero3 = strategy["fsdp_full"]
    assert zero3.baseline == "ddp" and len(zero3.pairs) == 1
    assert zero3.effects["peak"].measured == pytest.approx(0.6)
    assert zero3.effects["peak"].predicted == pytest.approx(0.58)
    assert zero3.effects["step"].measured == pytest.approx(3.0)
    assert zero3.effects["tokens"].measured == pytest.approx(1 / 3)
    assert zero3.effects["comm"].measured == pytest.approx(1.5)
    assert zero3.sentence.startswith("fsdp_full (ZeRO-3) held 0.60× ddp's peak per rank at 3.00× its step time")
    assert "over 1 pair;" in zero3.sentence and "the predictors say 0.58× the peak" in zero3.sentence
    assert list(_by_value(records, "precision")) == ["bf16"]
    assert _by_value(records, "checkpointing") == {}  # the run did not vary it


def test_the_effect_over_several_pairs_is_their_geometric_mean_with_the_range():
    records = [_record(model, peak=base, step=0.01) for model, base in (("gpt2-tiny", 100), ("llama-tiny", 200))]
    records += [_record("gpt2-tiny", precision="bf16", peak=50, step=0.01),
                _record("llama-tiny", precision="bf16", peak=400, step=0.01)]
    bf16 = _by_value(records, "precision")["bf16"]
    peak = bf16.effects["peak"]
    assert peak.measured == pytest.approx(1.0)  # 0.5× and 2×
    assert (peak.low, peak.high) == (pytest.approx(0.5), pytest.approx(2.0))
    # It lowers gpt2-tiny's peak and raises llama-tiny's: said, not averaged away.
    assert peak.disagree == (["gpt2-tiny"], ["llama-tiny"])
    assert "The pairs disagree on the peak: lower for gpt2-tiny, higher for llama-tiny." in bf16.sentence
    assert "disagree on the step time" not in bf16.sentence


def test_a_run_without_the_axis_baseline_takes_its_most_common_value_and_skips_cells_not_ok():
    records = [_record(precision="bf16", peak=80, step=0.01), _record(precision="fp16", peak=70, step=0.01),
               _record(precision="fp16", peak=70, step=0.01, optimizer="adam8bit"),
               _record(precision="bf16", peak=60, step=0.01, optimizer="adam8bit"),
               _record(precision="fp32", status="unsupported", peak=0, step=0)]
    found = _by_value(records, "precision")
    # No fp32 cell ran: bf16 and fp16 are as common; the first by name is the baseline.
    assert list(found) == ["fp16"] and found["fp16"].baseline == "bf16"
    assert found["fp16"].effects["peak"].measured == pytest.approx((70 / 80 * 70 / 60) ** 0.5)


def test_key_value_heads_pair_models_of_one_family_only():
    records = [_record("llama-tiny", peak=100, step=0.01), _record("llama-tiny-mha", peak=110, step=0.01),
               _record("gpt2-tiny", peak=90, step=0.01)]
    heads = _by_value(records, "heads")
    assert list(heads) == ["gqa"] and heads["gqa"].baseline == "mha"
    pairs = [(p.cell_id, p.baseline_id) for f in heads.values() for p in f.pairs]
    assert len(pairs) == 1 and all("gpt2" not in a + b for a, b in pairs)
    # The model axis pairs across families (its baseline: the first of the equally common models).
    models = [(p.model, p.baseline_id.split("/")[0]) for f in _by_value(records, "model").values() for p in f.pairs]
    assert sorted(models) == [("llama-tiny", "gpt2-tiny"), ("llama-tiny-mha", "gpt2-tiny")]
