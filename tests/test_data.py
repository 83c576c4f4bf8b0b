"""Real data (harness/data.py) and the convergence verdict (harness/convergence.py), without a
launch: each rank's sampler takes every training sample once per epoch, the ranks' samples of
a step are the reference's, the corpus splits as documented, bad data options are refused,
and the verdict follows the seeds' spread. (tests/test_numerics.py trains on it.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from harness import convergence, data, markers, suites
from harness.config import TRAIN_SAMPLES, CellSpec, StrategySpec


class Indices(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index)}


def taken(dataset: Dataset, batch: int, batches: int, replicas: int, rank: int, workers: int = 0) -> list[list[int]]:
    return [b["index"].tolist() for b in data.sampler_batches(dataset, batch, batches, replicas, rank, seed=3,
                                                               workers=workers)]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_ranks_take_each_sample_once_an_epoch_and_the_references_steps(accumulation):
    n, world, rows = 48, 2, 4  # global batch = world × rows × accumulation
    global_batch = world * rows * accumulation
    steps = 2 * n // global_batch  # two epochs
    per_rank = [taken(Indices(n), rows, steps * accumulation, world, rank, workers=2 if rank else 0)
                for rank in range(world)]
    reference = taken(Indices(n), global_batch, steps, 1, 0)
    for epoch in range(2):
        span = slice(epoch * n // global_batch * accumulation, (epoch + 1) * n // global_batch * accumulation)
        seen = sorted(i for rank in per_rank for batch in rank[span] for i in batch)
        assert seen == list(range(n)), "every sample exactly once per epoch, over the ranks"
    for step in range(steps):
        micro = slice(step * accumulation, (step + 1) * accumulation)
        ranks_step = sorted(i for rank in per_rank for batch in rank[micro] for i in batch)
        assert ranks_step == sorted(reference[step]), f"step {step}: not the reference's samples"
    assert reference[0] != reference[steps // 2], "set_epoch reshuffles the second epoch"


def test_the_corpus_splits_into_training_and_later_held_out_sequences():
    train, held_out, info = data.splits("stdlib_bytes", 64)
    assert len(train) == TRAIN_SAMPLES["stdlib_bytes"] == info["train_sequences"]
    assert len(held_out) == data.HELD_OUT_SEQUENCES
    sample = train[0]
    assert sample["input_ids"].shape == (64,) and torch.equal(sample["labels"], sample["input_ids"])
    corpus, _ = data.stdlib_corpus()
    assert bytes(train.sequences[0].tolist()) == corpus[:64]
    assert bytes(held_out.sequences[0].tolist()) == corpus[len(train) * 64:len(train) * 64 + 64]
    assert len(info["sha256"]) == 64


def test_the_digits_split_into_training_and_later_held_out_images():
    from sklearn.datasets import load_digits

    train, held_out, info = data.splits("digits", None)
    digits = load_digits()
    assert len(train) == TRAIN_SAMPLES["digits"] == info["train_samples"]
    assert len(held_out) == len(digits.target) - len(train) == info["held_out_samples"]
    first, later = train[0], held_out[0]
    assert first["pixel_values"].shape == (1, 8, 8) and first["pixel_values"].dtype == torch.float32
    assert first["pixel_values"].min() >= 0 and first["pixel_values"].max() <= 1
    assert torch.equal(first["pixel_values"][0] * data.DIGITS_MAX_VALUE, torch.tensor(digits.images[0]).float())
    assert later["labels"].item() == digits.target[len(train)]


def bytes_cell(strategy: str = "ddp", **options) -> CellSpec:
    cell = {k: options.pop(k) for k in ("model", "micro_batch", "eval_every", "data", "world_size") if k in options}
    return CellSpec(**{"model": "gpt2-bytes", "data": "stdlib_bytes", "micro_batch": 8, **cell},
                    strategy=StrategySpec(name=strategy, **options))


def test_data_options_are_checked():
    cell = bytes_cell(eval_every=25)
    assert "/stdlib_bytes/eval25/" in cell.cell_id and "data_stdlib_bytes" in markers.markers_of(cell)
    assert cell.reference().data == "stdlib_bytes" and cell.reference().eval_every == 25
    assert "data_synthetic" in markers.markers_of(CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp")))
    refusals = {
        "bert": dict(model="bert-tiny"),  # not a causal LM
        "applies to real data only": dict(data="synthetic", eval_every=10),
        "does not divide them": dict(micro_batch=3),
        "no held-out evaluation": dict(strategy="pp_gpipe"),
        "data=": dict(data="imagenet"),
    }
    for message, options in refusals.items():
        strategy = options.pop("strategy", "ddp")
        with pytest.raises(ValueError, match=message):
            bytes_cell(strategy, **options)
    bytes_cell(model="gpt2-tiny")  # its 512 tokens hold the 256 bytes


def test_loss_scaling_option():
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp", precision="fp16", loss_scaling="none"))
    assert "/scale_none/" in cell.cell_id and "scale_none" in markers.markers_of(cell)
    assert cell.reference().strategy.loss_scaling == "none"
    with pytest.raises(ValueError, match="applies to precision=fp16 only"):
        StrategySpec(name="ddp", loss_scaling="none")
    with pytest.raises(ValueError, match="loss_scaling"):
        StrategySpec(name="ddp", precision="fp16", loss_scaling="static")


def test_convergence_suite_lists_every_strategy_and_precision_with_the_seeds():
    cells = suites.cells_of("convergence", 2)
    seeds = {c.seed for c in cells if c.strategy.name == "single" and c.strategy.precision == "fp32"}
    assert seeds == set(convergence.SEEDS)
    combos = {(c.strategy.name, c.strategy.precision, c.strategy.loss_scaling) for c in cells}
    assert {(s, p, ls) for s in suites.CONVERGENCE_STRATEGIES for p, ls in
            (("fp32", "dynamic"), ("bf16", "dynamic"), ("fp16", "dynamic"), ("fp16", "none"))} == combos
    assert all(c.global_batch == 16 and c.steps == convergence.STEPS for c in cells)


def test_verdict_is_the_difference_against_the_seeds_spread():
    cell = convergence.cell("ddp", 2, precision="bf16")
    finals = {convergence.fp32_reference(cell, seed).cell_id: loss
              for seed, loss in zip(convergence.SEEDS, (2.00, 2.03, 1.98))}

    def record(loss: float) -> dict:
        return {"status": "ok", "evaluation": {"held_out_loss": [[0, 5.5], [200, loss]]}}

    def judged(loss: float, drop_seed: bool = False) -> dict:
        by_id = {cell_id: record(v) for cell_id, v in finals.items()} | {cell.cell_id: record(loss)}
        if drop_seed:
            by_id.pop(convergence.fp32_reference(cell, 2).cell_id)
        result = convergence.verdict(cell, lambda c: by_id.get(c.cell_id))
        assert result is not None
        return result

    within = judged(2.04)
    assert within["verdict"] == "within" and within["tolerance"] == pytest.approx(0.05)
    assert within["difference"] == pytest.approx(0.04)
    assert judged(2.06)["verdict"] == "worse" and judged(1.90)["verdict"] == "better"
    missing = judged(2.0, drop_seed=True)
    assert missing["verdict"] is None and "seed(s) [2]" in missing["reason"]
    synthetic = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"))
    assert convergence.verdict(synthetic, lambda c: None) is None


def test_report_tabulates_verdicts_and_draws_the_curves_over_the_band(tmp_path):
    from harness.report import figures, real_data

    cells = [convergence.cell("single", 2, seed=seed) for seed in convergence.SEEDS]
    cells.append(convergence.cell("ddp", 2, precision="fp16", loss_scaling="none"))
    finals = (2.00, 2.03, 1.98, 2.20)
    records = [{"cell_id": c.cell_id, "status": "ok", "cell": c.to_dict(), "model": {"name": c.model_name},
                "evaluation": {"held_out_loss": [[0, 5.5], [100, 3.0], [200, final]]}}
               for c, final in zip(cells, finals)]
    jobs: list = []
    section = real_data.section(records, tmp_path, jobs, page_of=str)
    assert section is not None
    by_id = {row["cell_id"]: row for row in section["rows"]}
    assert by_id[cells[-1].cell_id]["verdict"] == "worse" and by_id[cells[-1].cell_id]["difference"] == "+0.2000"
    assert by_id[cells[0].cell_id]["verdict"] == "within"
    assert [function for function, _ in jobs] == [figures.convergence_figure]
    function, arguments = jobs[0]
    function(*arguments)
    svg = (tmp_path / "convergence-gpt2-bytes.svg").read_text()
    assert "fp32, 3 seeds" in svg and "fp16, loss scaling none" in svg
