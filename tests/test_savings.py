"""`harness savings`: each ZeRO stage's memory against the DDP cell that differs from it in the
strategy alone, beside the ZeRO formula for the record's parameter count."""

from harness.config import CellSpec, StrategySpec
from harness.predict.formulas import FP32_ADAM, zero_model_states
from harness.report import savings
from harness.results.schema import make_record

N_PARAMS = 1_000_000
MIB = 2**20


def _record(strategy: str, peak: float, states: tuple[float, float, float], **options):
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=strategy, **options))
    params, grads, optimizer = states
    record = make_record(cell, markers=[], status="ok", n_params=N_PARAMS, metrics={
        "peak_mem_bytes": peak, "step_time_s": 0.5,
        "mem_breakdown_bytes": {"params": params, "grads": 0, "optimizer": optimizer, "activations": 1, "other": 0},
        "at_optimizer_step_bytes": {"params": params, "grads": grads, "optimizer": optimizer, "activations": 0}})
    return record


def test_each_stage_against_its_ddp_cell_beside_the_formula():
    ddp = _record("ddp", 20 * MIB, (4e6, 4e6, 8e6))
    zero1 = _record("zero1", 16 * MIB, (4e6, 4e6, 4e6))
    fsdp = _record("fsdp_full", 12 * MIB, (2e6, 2e6, 4e6))
    other_ckpt = _record("fsdp_full", 10 * MIB, (2e6, 2e6, 4e6), checkpointing="full")  # no DDP of its own
    eight_bit = _record("fsdp_full", 10 * MIB, (2e6, 2e6, 1e6), optimizer="adamw8bit")
    bf16 = _record("fsdp_full", 10 * MIB, (2e6, 2e6, 4e6), precision="bf16")
    rows = savings.rows([ddp, zero1, fsdp, other_ckpt, eight_bit, bf16])
    assert [(r["record"]["cell_id"], r["stage"]) for r in rows] == [(zero1["cell_id"], 1), (fsdp["cell_id"], 3)]
    one, three = rows
    assert one["baseline"] is ddp and one["peak_saving"] == 4 * MIB
    dp = zero_model_states(N_PARAMS, 2, 0, **FP32_ADAM).total
    assert one["formula_saving"] == dp - zero_model_states(N_PARAMS, 2, 1, **FP32_ADAM).total == 4e6
    assert three["formula_saving"] == dp - zero_model_states(N_PARAMS, 2, 3, **FP32_ADAM).total == 8e6
    assert one["states"] == 12e6 == one["formula_states"]  # held at the optimizer step
    assert three["states"] == 8e6 == three["formula_states"]
    table = savings.table([ddp, zero1, fsdp])
    assert table.count(ddp["cell_id"]) == 1  # the baseline once, above its rows
    lines = table.splitlines()
    assert lines[2].endswith("| — | — | 15.26 | 15.26 | 1.00 |")  # DDP: 16 bytes per parameter, as the formula
    assert lines[3].endswith("| 4.00 | 3.81 | 11.44 | 11.44 | 1.00 |")  # MiB
    assert table.endswith("(harness/report/savings.py).") and "MiB per rank" in table


def test_a_run_without_a_baseline_says_so():
    assert savings.table([_record("zero1", MIB, (1, 1, 1))]).startswith("No fp32 cell implementing a ZeRO stage")
