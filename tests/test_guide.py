"""The run page's selection guide (harness/report/guide.py): the measured Pareto front per
model and world size as "with at most X per rank, take Y", never a cell that failed the
gate, and plan's choice beside it for the real-size presets."""

from __future__ import annotations

from harness.config import CellSpec, StrategySpec
from harness.report import guide
from harness.results.schema import make_record


def _record(name: str, peak_mib: float, tokens: float, model: str = "gpt2-tiny", passed: bool = True, **options):
    cell = CellSpec(model=model, strategy=StrategySpec(name=name, **options))
    return make_record(cell, markers=[name], status="ok",
                       metrics={"peak_mem_bytes": peak_mib * 2**20, "tokens_per_s": tokens},
                       equivalence={"passed": passed, "reference_cell_id": cell.reference().cell_id})


def test_the_front_by_growing_budget_without_dominated_or_wrong_cells():
    records = [_record("fsdp_full", 10, 100), _record("ddp", 20, 300), _record("zero1", 15, 50),
               _record("fsdp_grad_op", 5, 400, passed=False)]
    (entry,) = guide.selection_guide(records)
    assert (entry["model"], entry["world_size"], entry["real_size"]) == ("gpt2-tiny", 2, False)
    assert [(r["budget"], r["label"].split("/")[0], r["tokens_per_s"]) for r in entry["rows"]] == [
        ("10.0 MiB", "fsdp_full", "100"), ("20.0 MiB", "ddp", "300")]
    assert all(r["plan"] is None for r in entry["rows"])  # a tiny model: no plan beside it


def test_a_real_size_preset_has_plans_choice_for_each_budget():
    records = [_record("ddp", 60 * 1024, 900, model="gpt2-124m", precision="bf16"),
               _record("fsdp_full", 0.5, 10, model="gpt2-124m", precision="bf16")]
    (entry,) = guide.selection_guide(records)
    roomy, tight = entry["rows"][1]["plan"], entry["rows"][0]["plan"]
    # 60 GiB per rank fits gpt2-124m under every strategy: plan names its fastest, in bf16.
    assert "/bf16/" in roomy["config"] and roomy["peak"].endswith("GiB")
    assert tight["config"].startswith("nothing fits; the least: ")  # half a MiB fits no configuration
