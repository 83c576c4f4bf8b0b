"""BatchNorm under data parallelism and virtual batches (harness/measure/batch_norm.py): what
each cell normalises over, which cells the same-loss gate leaves to the held-out measures,
the running statistics and held-out accuracy a real training run records (one-rank gloo
group, scikit-learn's digits), and SyncBatchNorm's refusal on CPU in torch's own words."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import equivalence, strategies, training
from harness.config import CellSpec, StrategySpec
from harness.measure import batch_norm
from harness.predict import analytic
from harness.strategies import ddp


def digits_cell(strategy: str = "single", world_size: int = 1, micro_batch: int = 16, steps: int = 6,
                **options) -> CellSpec:
    return CellSpec(model="convnet-digits", strategy=StrategySpec(name=strategy, **options), world_size=world_size,
                    micro_batch=micro_batch, steps=steps, data="digits", eval_every=3)


@pytest.mark.parametrize(("cell", "normalised_over"), [
    (digits_cell(), 16),  # the whole batch
    (digits_cell(accumulation=2, micro_batch=8), 8),  # a virtual batch: each micro-step's samples
    (digits_cell("ddp", 2, 8), 8),  # each rank's
    (digits_cell("ddp", 2, 4, accumulation=2), 4),  # each rank's micro-step's
    (digits_cell("ddp", 2, 8, sync_batch_norm=True), 16),  # the group's
    (digits_cell("ddp", 2, 4, accumulation=2, sync_batch_norm=True), 8),  # the group's micro-step's
])
def test_what_batch_norm_normalises_over(cell, normalised_over):
    assert cell.global_batch == 16
    assert batch_norm.statistics_batch(cell) == normalised_over


def test_the_gate_leaves_cells_normalising_over_less_than_the_whole_batch_to_the_held_out_measures():
    reference = {"status": "ok", "losses": [2.0] * 6}
    per_rank = equivalence.check(digits_cell("ddp", 2, 8), [2.5] * 6, reference)
    assert per_rank["passed"] is None and "BatchNorm normalises over 8 samples" in per_rank["reason"]
    # SyncBatchNorm over the whole batch computes the reference's function: gated as usual.
    synced = equivalence.check(digits_cell("ddp", 2, 8, sync_batch_norm=True), [2.5] * 6, reference)
    assert synced["passed"] is False
    # A model without BatchNorm split over ranks is gated however small its micro-batches.
    gpt2 = equivalence.check(CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"), micro_batch=1,
                                      steps=6), [2.5] * 6, reference)
    assert gpt2["passed"] is False


def test_running_statistics_difference_is_relative_to_the_reference():
    reference = {"running": {"a": {"running_mean": [3.0, 4.0], "running_var": [1.0, 1.0]}}}
    mine = {"running": {"a": {"running_mean": [3.0, 4.5], "running_var": [1.0, 1.0]}}}
    assert batch_norm.difference(mine, reference) == {"running_mean": pytest.approx(0.1), "running_var": 0.0}
    other_layers = {"running": {"b": mine["running"]["a"]}}
    assert batch_norm.difference(other_layers, reference) == {"running_mean": None, "running_var": None}


@pytest.mark.parametrize(("options", "refusal"), [
    ({"model": "gpt2-tiny", "strategy": StrategySpec(name="ddp", sync_batch_norm=True)},
     "gpt2-tiny has no BatchNorm layers"),
    ({"model": "convnet-digits", "strategy": StrategySpec(name="fsdp_full", sync_batch_norm=True)},
     "fsdp_full with sync_batch_norm=True"),
    ({"model": "convnet-digits", "strategy": StrategySpec(name="ddp"), "attention": "eager"},
     "has no attention"),
    ({"model": "gpt2-tiny", "strategy": StrategySpec(name="ddp"), "data": "digits"},
     "needs a convnet model for 8×8 grayscale images"),
    ({"model": "convnet-digits", "strategy": StrategySpec(name="ddp"), "data": "stdlib_bytes"},
     "needs a causal language model"),
])
def test_batch_norm_options_that_cannot_apply_are_refused(options, refusal):
    def checked() -> None:
        if problem := strategies.incompatibility(CellSpec(**options)):
            raise ValueError(problem)

    with pytest.raises(ValueError, match=refusal):
        checked()


def test_sync_batch_norm_is_recorded_unsupported_on_cpu_with_torchs_own_refusals(one_rank_env):
    cell = digits_cell("ddp", 2, 8, sync_batch_norm=True)
    assert strategies.unsupported_reason(cell, "cpu") == ddp.SYNC_BATCH_NORM_ON_CPU
    assert strategies.unsupported_reason(cell, "cuda") is None
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))
    with pytest.raises(ValueError) as refused_wrap:
        nn.parallel.DistributedDataParallel(model)
    with pytest.raises(ValueError) as refused_forward:
        model(torch.randn(2, 1, 4, 4))
    # The reason quotes both of torch's messages: still what this torch says.
    assert f'"{refused_wrap.value}"' in ddp.SYNC_BATCH_NORM_ON_CPU
    assert f'"{refused_forward.value}"' in ddp.SYNC_BATCH_NORM_ON_CPU


def test_a_run_on_the_digits_records_running_statistics_and_held_out_accuracy(one_rank_env):
    whole = training.run_cell(digits_cell(), one_rank_env)
    virtual = training.run_cell(digits_cell(accumulation=2, micro_batch=8), one_rank_env)
    for result in (whole, virtual):
        accuracy = result["evaluation"]["held_out_accuracy"]
        assert [steps for steps, _ in accuracy] == [0, 3, 6]
        assert all(0 <= right <= 1 for _, right in accuracy)
        assert result["evaluation"]["data"]["name"] == "digits"
        assert sorted(result["batch_norm"]["running"]) == [f"blocks.{i}.norm" for i in range(3)]
    assert (whole["batch_norm"]["statistics_batch"], virtual["batch_norm"]["statistics_batch"]) == (16, 8)
    # The same samples, normalised over halves: the running statistics end apart.
    apart = batch_norm.difference(virtual["batch_norm"], whole["batch_norm"])
    assert apart["running_mean"] > 1e-3 and apart["running_var"] > 1e-3
    # The analytic peak follows the convnet's activations (measured: within 0.4 %).
    for cell, result in ((digits_cell(), whole), (digits_cell(accumulation=2, micro_batch=8), virtual)):
        assert analytic.predict(cell, device_type="cpu")["peak_bytes"] / result["peak_mem_bytes"] == pytest.approx(
            1, abs=0.02)


def test_evaluation_uses_the_running_statistics_and_leaves_them_as_they_were(one_rank_env):
    session = training.prepare_cell(digits_cell(), one_rank_env)
    session.step(0)
    before = batch_norm.running_statistics(session.built.module)
    first = session.evaluate()
    assert batch_norm.running_statistics(session.built.module) == before  # eval mode: no update
    assert session.evaluate() == first
    assert session.prep.model.training  # back in training mode for the next step


def test_the_report_sets_each_batch_norm_cell_beside_the_whole_batch_run(tmp_path):
    from harness import convergence
    from harness.report import real_data

    def record(cell: CellSpec, status: str = "ok", mean: float = 0.0, accuracy: float = 0.9) -> dict:
        return {"cell_id": cell.cell_id, "status": status, "cell": cell.to_dict(), "model": {"name": cell.model_name},
                "reason": "" if status == "ok" else "no SyncBatchNorm here",
                "evaluation": {"held_out_loss": [[200, 0.5]], "held_out_accuracy": [[200, accuracy]]},
                "batch_norm": {"running": {"n": {"running_mean": [3.0, 4.0 + mean], "running_var": [1.0, 1.0]}}}}

    seeds = [convergence.cell("single", 2, seed=s, model=convergence.VISION_MODEL) for s in convergence.SEEDS]
    per_rank = convergence.cell("ddp", 2, model=convergence.VISION_MODEL)
    synced = convergence.cell("ddp", 2, model=convergence.VISION_MODEL, sync_batch_norm=True)
    records = [record(c) for c in seeds] + [record(per_rank, mean=0.5, accuracy=0.95),
                                            record(synced, status="unsupported")]
    section = real_data.section(records, tmp_path, [], page_of=str)
    assert section is not None
    rows = {row["cell_id"]: row for row in section["batch_norm"]}
    assert rows[per_rank.cell_id]["normalised_over"] == "8 of 16"
    assert rows[per_rank.cell_id]["mean_apart"] == "10.0 %" and rows[per_rank.cell_id]["var_apart"] == "0.0 %"
    assert (rows[per_rank.cell_id]["accuracy"], rows[per_rank.cell_id]["whole_batch_accuracy"]) == ("95.0 %", "90.0 %")
    assert rows[synced.cell_id]["status"] == "unsupported" and "SyncBatchNorm" in rows[synced.cell_id]["how"]
    assert [f["model"] for f in section["figures"]] == [convergence.VISION_MODEL]
