"""Folding a cell's trials (``--repeat N``) into the one record readers show:
harness/results/trials.py."""

import pytest

from harness.config import CellSpec, StrategySpec
from harness.results import trials
from harness.results.schema import make_record

DDP = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"))
FSDP = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="fsdp_full"))
PEAK = 5 * 2**20


def eq(diff: float, passed: bool = True) -> dict:
    return {"reference_cell_id": DDP.reference().cell_id, "max_rel_loss_diff": diff, "tolerance": 1e-5,
            "passed": passed, "reason": ""}


def ok(trial: int, step: float, cell: CellSpec = DDP, peak: int = PEAK, diff: float = 0.0, passed: bool = True):
    metrics = {"peak_mem_bytes": peak, "step_time_s": step, "tokens_per_s": 1000 / step, "mfu": None,
               "mfu_suspect": False, "mem_breakdown_bytes": {"params": peak}}
    return make_record(cell, markers=[], status="ok", metrics=metrics, losses=[6.0, 5.0 + trial],
                       per_rank=[{"rank": 0, "step_times_s": [step]}], equivalence=eq(diff, passed),
                       wall_s=1.0 + trial, trial=trial)


def test_a_single_trial_passes_through_with_n_1():
    record = ok(0, 0.01)
    folded = trials.combine([record])
    assert {k: v for k, v in folded.items() if k != "trials"} == record
    assert folded["trials"] == {"n": 1, "trial": [0], "status": ["ok"], "step_time_s": [0.01],
                                "peak_mem_bytes": [PEAK], "wall_s": [1.0], "spread": 0.0, "peak_mem_range_bytes": 0}
    unsupported = make_record(DDP, markers=[], status="unsupported", reason="needs CUDA")
    folded = trials.combine([unsupported])
    assert folded["status"] == "unsupported" and folded["reason"] == "needs CUDA" and folded["metrics"] == {}
    assert folded["trials"]["spread"] is None and folded["trials"]["peak_mem_range_bytes"] is None


def test_metrics_are_medians_and_the_rest_is_the_trial_nearest_the_median():
    folded = trials.combine([ok(0, 0.010), ok(1, 0.013), ok(2, 0.011)])
    m = folded["metrics"]
    assert m["step_time_s"] == 0.011 and m["tokens_per_s"] == pytest.approx(1000 / 0.011)
    assert m["peak_mem_bytes"] == PEAK and m["mfu"] is None and m["mem_breakdown_bytes"] == {"params": PEAK}
    assert folded["trial"] == 2 and folded["losses"] == [6.0, 7.0]  # trial 2 is the median one
    assert folded["status"] == "ok" and folded["wall_s"] == pytest.approx(6.0)  # 1 + 2 + 3: the cell's time
    t = folded["trials"]
    assert t["n"] == 3 and t["trial"] == [0, 1, 2] and t["step_time_s"] == [0.010, 0.013, 0.011]
    assert t["spread"] == pytest.approx(0.003 / 0.011) and t["peak_mem_range_bytes"] == 0


def test_an_even_number_of_trials_averages_the_middle_two_and_shows_the_earliest_nearest():
    folded = trials.combine([ok(0, 0.5, peak=PEAK + 4096), ok(1, 0.25)])  # exact in binary: a true tie
    assert folded["metrics"]["step_time_s"] == 0.375
    assert folded["metrics"]["peak_mem_bytes"] == PEAK + 2048
    assert folded["trial"] == 0  # both 0.125 s from the median: the earlier one
    assert folded["trials"]["peak_mem_range_bytes"] == 4096  # peak memory moved: said, not hidden
    # A rank's number names a rank: the shown trial's, never a median (1.0 or 1.5).
    counted = [ok(t, step) for t, step in ((0, 0.5), (1, 0.25))]
    for record in counted:
        record["metrics"]["comm_counted_rank"] = 1
    assert trials.combine(counted)["metrics"]["comm_counted_rank"] == 1
    assert isinstance(trials.combine(counted)["metrics"]["comm_counted_rank"], int)


def test_a_cell_is_ok_only_when_every_trial_is():
    timeout = make_record(DDP, markers=[], status="timeout", reason="no result after 600 s\nlog tail", trial=1,
                          wall_s=600.0)
    folded = trials.combine([ok(0, 0.010), timeout, ok(2, 0.012)])
    assert folded["status"] == "timeout" and folded["trial"] == 1 and folded["metrics"] == {}
    assert folded["reason"].splitlines()[0] == "2 of 3 trials ok; trial 1: no result after 600 s"
    assert folded["equivalence"] is None
    t = folded["trials"]
    assert t["status"] == ["ok", "timeout", "ok"] and t["step_time_s"] == [0.010, None, 0.012]
    assert t["spread"] == pytest.approx(0.002 / 0.011)  # of the ok trials, still shown
    failed = make_record(DDP, markers=[], status="failed", reason="boom", trial=0)
    assert trials.combine([failed, failed | {"trial": 1}])["reason"] == "0 of 2 trials ok; trial 0: boom"


def test_equivalence_is_the_worst_trial():
    assert trials.combine([ok(0, 0.01, diff=1e-7), ok(1, 0.01, diff=3e-7), ok(2, 0.01, diff=2e-7)])[
        "equivalence"]["max_rel_loss_diff"] == 3e-7
    folded = trials.combine([ok(0, 0.01, diff=1e-7), ok(1, 0.01, diff=2e-3, passed=False), ok(2, 0.01)])
    assert folded["status"] == "ok" and not folded["equivalence"]["passed"]
    reference = make_record(DDP.reference(), markers=[], status="ok", metrics={"step_time_s": 0.01})
    assert trials.combine([reference, reference | {"trial": 1}])["equivalence"] is None


def test_aggregate_groups_interleaved_trials_per_cell_in_first_seen_order():
    records = [ok(0, 0.01, FSDP), ok(0, 0.02), ok(1, 0.03, FSDP), ok(1, 0.04), ok(1, 0.05, FSDP)]
    folded = trials.aggregate(records)
    assert [(r["cell_id"], r["trials"]["n"]) for r in folded] == [(FSDP.cell_id, 2), (DDP.cell_id, 2)]
    assert folded[0]["trials"]["step_time_s"] == [0.01, 0.05]  # the later record of a (cell, trial) stands
    assert trials.aggregate([]) == []
