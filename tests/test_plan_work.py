"""A planned step's work from its first blocks (harness/predict/plan_work.py): what ``plan
--calibration`` prices at a run's rates."""

import pytest

from harness import models
from harness.config import CellSpec, StrategySpec
from harness.measure import dispatched_work
from harness.models import sources
from harness.predict import analytic, plan_work, step_time, traced


def _work(ops, flops, nbytes, attention=0.0) -> dict:
    return {"ops": ops, "matmul_flops": flops, "matmul_flops_by_size": [[2**20, flops]],
            "attention_flops_by_size": {"forward": [[2**10, attention]]} if attention else {},
            "convolution_flops_by_size": {}, "topk_elements_by_size": [],
            "memory_bytes": [[2**16, nbytes]], "collectives": {"all_reduce": [[2**20, 3]]}}


def test_each_block_beyond_the_first_adds_the_seconds_increment():
    one, two = _work(100, 10.0, 1000.0, attention=4.0), _work(150, 16.0, 1300.0, attention=8.0)
    work = plan_work.extrapolated(one, two, 12)
    assert (work["ops"], work["matmul_flops"]) == (100 + 11 * 50, 10.0 + 11 * 6.0)
    assert work["matmul_flops_by_size"] == [[2**20, 76.0]] and work["memory_bytes"] == [[2**16, 4300.0]]
    assert work["attention_flops_by_size"] == {"forward": [[2**10, 48.0]]}
    # 3 calls of 1 MiB at each depth: their count and bytes grow alike, spread evenly.
    assert work["collectives"] == {"all_reduce": [[2**20, 3.0]]}
    # A library optimizer's update calls and elements grow alike, each block its own.
    one["optimizer_ops"], two["optimizer_ops"] = {"u/adam": [3, 300]}, {"u/adam": [5, 500], "u32/adam": [1, 10]}
    assert plan_work.extrapolated(one, two, 4)["optimizer_ops"] == {"u/adam": [9.0, 900.0], "u32/adam": [3.0, 30.0]}
    two["collectives"] = {"all_reduce": [[2**20, 3], [2**19, 2]], "broadcast": [[64, 1]]}
    grown = plan_work.extrapolated(one, two, 3)["collectives"]
    assert grown["all_reduce"] == [[(3 * 2**20 + 4 * 2**19) / 7, 7.0]] and grown["broadcast"] == [[64, 2.0]]


def test_a_model_of_identical_blocks_is_its_first_two_extrapolated():
    """The module docstring's claim on a small decoder, four blocks traced whole."""
    deep = sources.at_depth(models.get_preset("gpt2-tiny"), 4)
    cells = [CellSpec(model=sources.at_depth(deep, k), strategy=StrategySpec(name="ddp"), world_size=2)
             for k in (1, 2)] + [CellSpec(model=deep, strategy=StrategySpec(name="ddp"), world_size=2)]
    one, two, whole = (traced.trace(c)["work"] for c in cells)
    work = plan_work.extrapolated(one, two, 4)
    assert work["ops"] == whole["ops"] and work["matmul_flops"] == pytest.approx(whole["matmul_flops"])
    assert sum(b for _, b in work["memory_bytes"]) == pytest.approx(sum(b for _, b in whole["memory_bytes"]), rel=1e-3)


def test_configurations_that_dispatch_alike_share_their_traces_and_an_offloaded_optimizer_leaves_the_device():
    def cell(name, **options):
        return CellSpec(model="gpt2-124m", strategy=StrategySpec(name=name, precision="bf16", **options),
                        world_size=8, seq_len=256)

    plain, offloaded, activations = (cell("deepspeed_zero2"), cell("deepspeed_zero2", offload="optimizer"),
                                     cell("deepspeed_zero2", checkpointing="offload"))
    asked: list[list[str]] = []

    def trace(cells):
        asked.append([c.cell_id for c in cells])
        return {c.cell_id: {"work": _work(c.model_spec.n_layers * 100, 1e9, 1e10)} for c in cells}

    works = plan_work.stand_ins([plain, offloaded, activations], trace, "cuda")
    assert len(asked) == 1 and len(asked[0]) == 2  # one configuration at 1 and 2 blocks
    base = works[plain.cell_id]["stand_in"]
    assert base["strategy"] == "deepspeed_zero2" and base["cell_id"].startswith("gpt2-124m-2-blocks/")
    assert works[activations.cell_id]["stand_in"]["work"] == base["work"]
    # The offloaded optimizer's counted step (the CPU trace's AdamW) over the rank's shard is off the device.
    shard = step_time.optimizer_elements(plain, analytic.predict(plain))
    removed = shard * dispatched_work.optimizer_step_work("adamw", "cpu")["bytes_per_element"]
    kept = works[offloaded.cell_id]["stand_in"]["work"]["memory_bytes"][0][1]
    assert kept == pytest.approx(max(0.0, base["work"]["memory_bytes"][0][1] - removed))
    # On a CPU host the optimizer steps on the cores it computes on either way.
    on_cpu = plan_work.stand_ins([offloaded], trace, "cpu")[offloaded.cell_id]["stand_in"]["work"]
    assert on_cpu == base["work"]


def test_a_failed_shallow_trace_leaves_the_analytic_work_and_says_why():
    cell = CellSpec(model="gpt2-124m", strategy=StrategySpec(name="ddp"), world_size=2)
    works = plan_work.stand_ins([cell], lambda cells: {c.cell_id: {"unavailable": "boom"} for c in cells}, "cuda")
    assert works == {cell.cell_id: {"unavailable": "planned; its trace at (1, 2) blocks: boom"}}


def test_a_model_no_deeper_than_the_traced_blocks_is_traced_whole_once():
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"), world_size=2)  # 2 blocks
    asked: list[list[str]] = []

    def trace(cells):
        asked.append([c.cell_id for c in cells])
        return {c.cell_id: {"work": _work(c.model_spec.n_layers * 100, 1e9, 1e10)} for c in cells}

    works = plan_work.stand_ins([cell], trace, "cpu")
    assert asked == [["gpt2-tiny-2-blocks/ddp/fp32/ckpt_none/mb2/ws2/seed0"]]
    assert works[cell.cell_id] == {"unavailable": "planned: traced whole (2 blocks)",
                                   "stand_in": {"cell_id": asked[0][0], "strategy": "ddp",
                                                "work": _work(200, 1e9, 1e10)}}
