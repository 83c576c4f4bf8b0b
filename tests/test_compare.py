"""harness.report.compare_stats and compare on synthetic runs (no training)."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

from harness import markers
from harness.config import CellSpec, StrategySpec
from harness.report import compare, compare_stats
from harness.results.schema import make_record
from harness.results.store import RunStore

N_CELLS = 20
STEPS = 30
BASE_MEM = 100 * 2**20
TOKENS_PER_STEP = 2 * 2 * 64


def _cell(i: int) -> CellSpec:
    return CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"), seed=i)


CELLS = [_cell(i) for i in range(N_CELLS)]


def _ok_record(cell: CellSpec, rng: np.random.Generator, *, base_time: float = 0.05,
               time_scale: float = 1.0, mem_scale: float = 1.0, steps: int = STEPS) -> dict:
    per_rank = []
    for rank in range(cell.world_size):
        times = base_time * time_scale * rng.lognormal(0.0, 0.03, size=steps)
        per_rank.append({"rank": rank, "peak_mem_bytes": int(BASE_MEM * mem_scale),
                         "step_time_s": float(np.median(times)), "step_times_s": times.tolist()})
    slowest = np.max([r["step_times_s"] for r in per_rank], axis=0)
    step_time = float(np.median(slowest))
    metrics = {"peak_mem_bytes": round(BASE_MEM * mem_scale), "step_time_s": step_time,
               "samples_per_s": cell.global_batch / step_time, "tokens_per_s": TOKENS_PER_STEP / step_time}
    return make_record(cell, markers=markers.markers_of(cell), status="ok", n_params=1000,
                       metrics=metrics, per_rank=per_rank, losses=[6.0] * cell.steps)


def _write_run(results, run_id: str, records: list[dict]):
    store = RunStore(results, run_id)
    store.write_run_info({"run_id": run_id, "suite": "synthetic"})
    for r in records:
        store.append(r)
    return store.path


def _by_id(comparisons):
    return {c.cell_id: c for c in comparisons}


@pytest.fixture
def same_code(tmp_path):
    a = _write_run(tmp_path, "a", [_ok_record(c, np.random.default_rng(1000 + i)) for i, c in enumerate(CELLS)])
    b = _write_run(tmp_path, "b", [_ok_record(c, np.random.default_rng(2000 + i)) for i, c in enumerate(CELLS)])
    return a, b


def test_same_code_twice_is_mostly_not_significant(same_code):
    comparisons = compare_stats.compare_runs(*same_code)
    assert len(comparisons) == N_CELLS and all(c.kind == "compared" for c in comparisons)
    not_sig = [c for c in comparisons if c.time.mark == compare_stats.NOT_SIGNIFICANT]
    assert len(not_sig) >= 0.9 * N_CELLS
    assert all(c.mem.mark == compare_stats.SAME for c in comparisons)
    assert all(c.time.p_value is not None and c.time.n_a == STEPS for c in comparisons)
    assert compare_stats.regressions(comparisons, "mem:5%,time:10%,throughput:10%") == []


def _with_changes(tmp_path, changes: dict[int, dict], b_records_extra=(), drop_b=()):
    rec_a = [_ok_record(c, np.random.default_rng(1000 + i)) for i, c in enumerate(CELLS)]
    rec_b = []
    for i, c in enumerate(CELLS):
        if i in drop_b:
            continue
        change = changes.get(i, {})
        if "status" in change:
            rec_b.append(make_record(c, markers=[], status=change["status"], reason=change.get("reason", "")))
        else:
            rec_b.append(_ok_record(c, np.random.default_rng(2000 + i), **change))
    a = _write_run(tmp_path, "a", rec_a)
    b = _write_run(tmp_path, "b", rec_b + list(b_records_extra))
    return a, b, compare_stats.compare_runs(a, b)


def test_slowed_cell_is_worse_and_caught_by_time_threshold(tmp_path):
    _, _, comparisons = _with_changes(tmp_path, {3: {"time_scale": 1.3}})
    slowed = _by_id(comparisons)[CELLS[3].cell_id]
    assert slowed.time.mark == compare_stats.WORSE and slowed.time.p_value < 0.05
    assert slowed.time.ratio == pytest.approx(1.3, rel=0.05)
    assert slowed.throughput.mark == compare_stats.WORSE and slowed.throughput.change < -0.2
    assert slowed.verdict == compare_stats.WORSE
    found = compare_stats.regressions(comparisons, "time:10%")
    assert [r.cell_id for r in found] == [CELLS[3].cell_id]
    assert compare_stats.regressions(comparisons, "time:50%") == []
    assert [r.cell_id for r in compare_stats.regressions(comparisons, "throughput:10%")] == [CELLS[3].cell_id]


def test_faster_cell_is_better(tmp_path):
    _, _, comparisons = _with_changes(tmp_path, {5: {"time_scale": 0.7}})
    faster = _by_id(comparisons)[CELLS[5].cell_id]
    assert faster.time.mark == compare_stats.BETTER and faster.time.p_value < 0.05
    assert faster.throughput.mark == compare_stats.BETTER and faster.verdict == compare_stats.BETTER
    assert compare_stats.regressions(comparisons, "time:1%,throughput:1%") == []


def test_memory_increase_is_worse_and_small_change_is_not(tmp_path):
    _, _, comparisons = _with_changes(tmp_path, {1: {"mem_scale": 1.10}, 2: {"mem_scale": 1.001},
                                                 4: {"mem_scale": 0.9}})
    by_id = _by_id(comparisons)
    assert by_id[CELLS[1].cell_id].mem.mark == compare_stats.WORSE
    assert by_id[CELLS[1].cell_id].mem.change == pytest.approx(0.10, abs=1e-6)
    assert by_id[CELLS[2].cell_id].mem.mark == compare_stats.NOT_SIGNIFICANT
    assert by_id[CELLS[4].cell_id].mem.mark == compare_stats.BETTER
    assert [r.cell_id for r in compare_stats.regressions(comparisons, "mem:5%")] == [CELLS[1].cell_id]
    assert compare_stats.regressions(comparisons, "mem:15%") == []


def test_ok_to_failed_is_a_regression_whatever_the_thresholds(tmp_path):
    _, _, comparisons = _with_changes(tmp_path, {7: {"status": "failed", "reason": "boom"}})
    failed = _by_id(comparisons)[CELLS[7].cell_id]
    assert failed.kind == "status_change" and failed.verdict == compare_stats.WORSE
    assert failed.status_a == "ok" and failed.status_b == "failed"
    for spec in ("mem:5%", "time:50%", {}):
        assert [r.cell_id for r in compare_stats.regressions(comparisons, spec)] == [CELLS[7].cell_id]


def test_failed_to_ok_is_better_not_a_regression(tmp_path):
    rec_a = [make_record(CELLS[0], markers=[], status="oom", reason="CUDA out of memory")]
    rec_b = [_ok_record(CELLS[0], np.random.default_rng(0))]
    comparisons = compare_stats.compare_runs(_write_run(tmp_path, "a", rec_a), _write_run(tmp_path, "b", rec_b))
    assert comparisons[0].kind == "status_change" and comparisons[0].verdict == compare_stats.BETTER
    assert compare_stats.regressions(comparisons, "time:1%") == []


def test_cells_only_in_one_run_are_listed(tmp_path):
    extra = _cell(99)
    _, _, comparisons = _with_changes(tmp_path, {}, b_records_extra=[_ok_record(extra, np.random.default_rng(9))],
                                      drop_b={0})
    by_id = _by_id(comparisons)
    assert by_id[CELLS[0].cell_id].kind == "only_a"
    assert by_id[extra.cell_id].kind == "only_b"
    assert compare_stats.regressions(comparisons, "mem:1%,time:1%") == []
    text = compare.to_text(comparisons)
    assert "only in A" in text and "only in B" in text
    assert "1 only in A" in compare.summary(comparisons)


def test_too_few_samples_is_not_significant(tmp_path):
    rec_a = [_ok_record(CELLS[0], np.random.default_rng(0), steps=3)]
    rec_b = [_ok_record(CELLS[0], np.random.default_rng(1), steps=3, time_scale=2.0)]
    comparisons = compare_stats.compare_runs(_write_run(tmp_path, "a", rec_a), _write_run(tmp_path, "b", rec_b))
    time = comparisons[0].time
    assert time.mark == compare_stats.NOT_SIGNIFICANT and time.note == "too few samples" and time.p_value is None
    assert time.change == pytest.approx(1.0, rel=0.2)


def test_mann_whitney_matches_hand_computed_values():
    u, p = compare_stats.mann_whitney_u([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert u == 0 and p == pytest.approx(0.012186, abs=1e-5)
    u, p = compare_stats.mann_whitney_u([1, 2, 2, 3, 4], [2, 3, 3, 5, 6, 6])  # ties
    assert u == 6 and p == pytest.approx(0.11305, abs=1e-4)
    assert compare_stats.mann_whitney_u([1, 1, 1], [1, 1]) == (3.0, 1.0)


def test_slowest_rank_series_takes_the_max_per_step():
    record = {"per_rank": [{"step_times_s": [1.0, 5.0, 2.0]}, {"step_times_s": [3.0, 1.0, 2.5]}]}
    assert compare_stats.slowest_rank_series(record) == [3.0, 5.0, 2.5]
    assert compare_stats.slowest_rank_series({"per_rank": []}) == []


@pytest.mark.parametrize("spec", ["mem=5", "cpu:5%", "time:abc", "time:10", "mem:5%,mem:6%", "", "time:-5%"])
def test_bad_fail_on_raises_naming_the_keys(spec):
    with pytest.raises(ValueError) as info:
        compare_stats.parse_thresholds(spec)
    message = str(info.value)
    assert "\n" not in message
    for key in compare_stats.THRESHOLD_KEYS:
        assert key in message


def test_fail_on_parses():
    assert compare_stats.parse_thresholds("mem:5%, time:10%,throughput:2.5%") == pytest.approx(
        {"mem": 0.05, "time": 0.10, "throughput": 0.025})
    assert compare_stats.parse_thresholds(None) == {}


def test_markdown_has_table_and_summary(tmp_path):
    _, _, comparisons = _with_changes(tmp_path, {3: {"time_scale": 1.3}, 5: {"time_scale": 0.7},
                                                 7: {"status": "failed", "reason": "Traceback\nRuntimeError: a | b"}})
    md = compare.to_markdown(comparisons, "a", "b")
    assert "| cell | status | peak mem | step time | throughput | verdict |" in md
    assert "|---|" in md
    line = compare.summary(comparisons)
    assert line in md
    better, worse = int(line.split()[0]), int(line.split(", ")[1].split()[0])
    assert better >= 1 and worse >= 1 and "not significant" in line
    assert "❌" in md and "✅" in md and "| ok → failed: RuntimeError: a \\| b |" in md
    assert re.search(r"p=\d\.\de-\d\d", md)


def test_html_is_standalone_and_escaped(tmp_path):
    _, _, comparisons = _with_changes(tmp_path, {7: {"status": "failed", "reason": "<script>alert(1)</script>"}})
    html = compare.to_html(comparisons, "<b>base</b>", "cand&<i>")
    assert "<b>base</b>" not in html and "&lt;b&gt;base&lt;/b&gt;" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "cand&amp;&lt;i&gt;" in html
    assert "<style>" in html and "<link" not in html and "src=" not in html
    page = compare.write_html(tmp_path / "out" / "compare.html", comparisons, "a", "b")
    assert page.read_text(encoding="utf-8").startswith("<!doctype html>")


def test_main_compare_exit_codes(tmp_path, capsys):
    a, b, _ = _with_changes(tmp_path, {3: {"time_scale": 1.3}})
    stream = io.StringIO()
    assert compare.main_compare(a, b, "markdown", None, None, stream=stream) == 0
    assert "| cell |" in stream.getvalue()
    assert compare.main_compare(a, b, "text", "time:10%", None, stream=io.StringIO()) == 1
    assert CELLS[3].cell_id in capsys.readouterr().err
    assert compare.main_compare(a, b, "text", "time:50%", None, stream=io.StringIO()) == 0
    out = tmp_path / "cmp.html"
    assert compare.main_compare(a, b, "html", "mem:5%", out, stream=io.StringIO()) == 0
    assert "<table>" in out.read_text(encoding="utf-8")
    with pytest.raises(ValueError):
        compare.main_compare(a, b, "pdf", None, None)
    with pytest.raises(ValueError):
        compare.main_compare(a, b, "text", "cpu:5%", None)


def _trials_of(cell: CellSpec, seed: int, n: int, **change) -> list[dict]:
    return [{**_ok_record(cell, np.random.default_rng(seed + t), steps=3, **change), "trial": t} for t in range(n)]


def test_trials_are_pooled_for_the_rank_test_and_one_failed_trial_is_a_regression(tmp_path):
    # 3 trials of 3 steps: too few samples in any one trial, 9 pooled.
    a = _write_run(tmp_path, "a", _trials_of(CELLS[0], 100, 3) + _trials_of(CELLS[1], 200, 3))
    flaky = _trials_of(CELLS[1], 400, 3)
    flaky[2] = make_record(CELLS[1], markers=[], status="timeout", reason="hung", trial=2)
    b = _write_run(tmp_path, "b", _trials_of(CELLS[0], 300, 3, time_scale=1.5) + flaky)
    slowed, failed = compare_stats.compare_runs(a, b)
    assert slowed.time.n_a == slowed.time.n_b == 9 and slowed.time.mark == compare_stats.WORSE
    assert slowed.time.ratio == pytest.approx(1.5, rel=0.1)
    assert slowed.mem.mark == compare_stats.SAME  # the median peak of identical trials
    assert failed.kind == "status_change" and failed.status_b == "timeout" and failed.verdict == compare_stats.WORSE
    assert failed.reason_b.startswith("2 of 3 trials ok; trial 2: hung")
    assert [r.cell_id for r in compare_stats.regressions([slowed, failed], "mem:5%")] == [CELLS[1].cell_id]
