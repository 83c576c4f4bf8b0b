"""Numerics: the record's per-step loss scale, skipped steps and gradient norm, the gradients
against the compute precision's range, gradient clipping each engine's way, and fp16 under
FSDP2 with torch's ShardedGradScaler; the gate catching a clip made before unscale_. And
training on real data (harness/data.py): the held-out loss in the record."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from harness import faults, markers, strategies, suites
from harness.config import CellSpec, StrategySpec
from harness.equivalence import max_rel_diff, tolerance
from harness.features import clipping
from harness.measure import numerics
from harness.report.html import numerics_rows

# The default suite's clipping cells (harness/suites.py says why SGD).
CLIP = suites.CLIP_GRAD_NORM
SGD = {"optimizer": "sgd", "lr": suites.CLIP_LR}


def gpt2(strategy: str, **options) -> CellSpec:
    cell = {key: options.pop(key) for key in ("micro_batch", "lr") if key in options}
    return CellSpec(model="gpt2-tiny", world_size=1 if strategy == "single" else 2,
                    strategy=StrategySpec(name=strategy, **options), **cell)


# --- without a launch ------------------------------------------------------------------------


def test_gradient_range_counts_what_the_cast_loses():
    # As held (scale 2^10): 1e-9·2^10 ≈ 1e-6 is subnormal in fp16; 1e-3 and 1 are normal.
    # Without the scale 1e-9 is zero in fp16 and 1e-6 subnormal.
    grads = [torch.tensor([0.0, 1e-9, 1e-6, 1e-3, 1.0]) * 2**10]
    found = numerics.gradient_range(grads, torch.float16, 2.0**10, torch.device("cpu"))
    assert found["values"] == 5 and found["zero_in_fp32"] == 1
    assert found["zero_or_subnormal"] == 2  # 0 and 1e-9·2^10
    assert found["zero_or_subnormal_unscaled"] == 3  # 0, 1e-9, 1e-6
    assert found["fraction_zero_or_subnormal_unscaled"] == pytest.approx(0.6)
    # |1.0·2^10| lies in [2^10, 2^11); zero has no exponent.
    assert [10, 1] in found["log2_histogram"] and sum(n for _, n in found["log2_histogram"]) == 4
    bf16 = numerics.gradient_range(grads, torch.bfloat16, 2.0**10, torch.device("cpu"))
    assert bf16["zero_or_subnormal"] == bf16["zero_or_subnormal_unscaled"] == 1  # bf16 has fp32's range


def test_numerics_log_reads_a_skipped_step_from_the_falling_scale():
    param = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    log = numerics.NumericsLog(3, scaler)
    for i, factor in enumerate([1.0, math.inf, 1.0]):
        scaler.scale((param * factor).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        log.after_harness_step(i)
    assert log.skipped_steps == [1]
    assert log.loss_scale == [2.0**16, 2.0**15, 2.0**15]
    assert param.item() == pytest.approx(0.8)  # two clean SGD steps of 0.1, the overflowed one skipped


def test_torch_clip_measures_and_clips_as_torch_does():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    model(torch.randn(3, 8)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    clip = clipping.torch_clip(model.parameters())
    norm = clip(math.inf)  # measures only
    assert norm == pytest.approx(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert clip(0.1) == pytest.approx(norm.item())  # the norm before clipping
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert clipped.item() == pytest.approx(0.1, rel=1e-4)


def test_clip_option_is_checked_named_and_carried_by_the_reference():
    cell = gpt2("ddp", clip_grad_norm=1.0)
    assert "/clip1/" in cell.cell_id and "clip" in markers.markers_of(cell)
    assert cell.reference().strategy.clip_grad_norm == 1.0
    assert "clip" not in markers.markers_of(gpt2("ddp"))
    for bad in (0, -1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match="clip_grad_norm"):
            StrategySpec(name="ddp", clip_grad_norm=bad)
    megatron = CellSpec(model="gpt2-tiny", world_size=2, attention="eager",
                        strategy=StrategySpec(name="megatron", tp_degree=2, clip_grad_norm=1.0))
    assert "not wired" in strategies.incompatibility(megatron)


def test_fp16_is_refused_only_with_a_measured_reason():
    # FairScale's scaler disables itself without CUDA: unsupported on this host, not refused.
    assert strategies.incompatibility(gpt2("fairscale_sdp", precision="fp16")) is None
    assert "needs CUDA" in strategies.unsupported_reason(gpt2("fairscale_sdp", precision="fp16"), "cpu")
    for name in ("fsdp_full", "fsdp1_full", "fsdp_grad_op"):
        assert strategies.incompatibility(gpt2(name, precision="fp16")) is None


# --- the shared run: fp16 with clipping under DDP and FSDP2, and the fault ---------------------

REFERENCE = gpt2("single", precision="fp16", clip_grad_norm=CLIP, micro_batch=4, **SGD)
UNCLIPPED = gpt2("single", precision="fp16", micro_batch=4, **SGD)
DDP = gpt2("ddp", precision="fp16", clip_grad_norm=CLIP, **SGD)
FSDP2 = gpt2("fsdp_full", precision="fp16", clip_grad_norm=CLIP, **SGD)
# The same global batch and reference as DDP's, so a cell id of its own for the fault.
CLIPPED_BEFORE_UNSCALE = gpt2("ddp", precision="fp16", clip_grad_norm=CLIP, micro_batch=1, accumulation=2, **SGD)
SDP_FP16 = gpt2("fairscale_sdp", precision="fp16")
# A pipeline's norm summed over its stages, the tied table once (fp32: its own reference).
PIPELINE = gpt2("pp_1f1b", clip_grad_norm=CLIP, pp_microbatches=2, **SGD)
PIPELINE_REFERENCE = gpt2("single", clip_grad_norm=CLIP, micro_batch=4, **SGD)
# Real data: the standard library's bytes, the held-out loss before, halfway and after.
BYTES_REFERENCE, BYTES_DDP = (CellSpec(model="gpt2-bytes", strategy=StrategySpec(name=name), world_size=world,
                                       micro_batch=16 // world, steps=12, data="stdlib_bytes", eval_every=6)
                              for name, world in (("single", 1), ("ddp", 2)))


# Run in tests/conftest.py's shared_matrix.
MATRIX_CELLS = [REFERENCE, UNCLIPPED, DDP, FSDP2, CLIPPED_BEFORE_UNSCALE, SDP_FP16, PIPELINE_REFERENCE, PIPELINE,
                BYTES_REFERENCE, BYTES_DDP]
MATRIX_FAULTS = {CLIPPED_BEFORE_UNSCALE: faults.CLIP_BEFORE_UNSCALE}


@pytest.fixture(scope="module")
def records(shared_matrix) -> dict[str, dict]:
    assert CLIPPED_BEFORE_UNSCALE.reference() == REFERENCE == DDP.reference() == FSDP2.reference()
    return shared_matrix.records


@pytest.mark.parametrize("cell", [DDP, FSDP2], ids=lambda c: c.cell_id)
def test_fp16_with_clipping_trains_the_references_model(records, cell):
    record = records[cell.cell_id]
    assert record["status"] == "ok", record["reason"]
    assert record["equivalence"]["passed"], record["equivalence"]


def test_a_pipeline_clips_by_the_norm_over_its_stages_as_the_reference_does(records):
    """Each stage's rank holds part of the gradients (the tied table on the first and the last):
    the norm every step is the reference's, and the clipped steps train its model. Each rank
    clipping by its own part's norm, or the table counted twice, failed the gate (relative
    loss differences 2.3e-3 and 3.9e-4 against its 1e-5)."""
    assert PIPELINE.reference() == PIPELINE_REFERENCE
    record = records[PIPELINE.cell_id]
    assert record["status"] == "ok", record["reason"]
    assert record["equivalence"]["passed"], record["equivalence"]
    norms = record["numerics"]["grad_norm"]
    assert all(norm > CLIP for norm in norms)
    assert norms == pytest.approx(records[PIPELINE_REFERENCE.cell_id]["numerics"]["grad_norm"], rel=1e-5)


def test_clipping_changes_the_losses_beyond_the_gate(records):
    """Else a strategy that ignored the option would pass the gate."""
    clipped, unclipped = records[REFERENCE.cell_id]["losses"], records[UNCLIPPED.cell_id]["losses"]
    assert max_rel_diff(clipped, unclipped) > 3 * tolerance(DDP)


def test_the_gate_catches_a_clip_before_unscale(records):
    record = records[CLIPPED_BEFORE_UNSCALE.cell_id]
    assert record["status"] == "ok", record["reason"]
    assert record["equivalence"]["passed"] is False
    assert record["equivalence"]["max_rel_loss_diff"] > 3 * tolerance(CLIPPED_BEFORE_UNSCALE)


def test_record_keeps_every_steps_numerics(records):
    for cell in (DDP, FSDP2):
        n = records[cell.cell_id]["numerics"]
        assert n["loss_scale"] == [2.0**16] * cell.steps  # no overflow in 10 steps: the initial scale
        assert n["skipped_steps"] == []
        # A clipping cell has its norm every step; ranks and strategies agree on it.
        assert all(norm > CLIP for norm in n["grad_norm"])
        assert n["grad_norm"] == pytest.approx(records[REFERENCE.cell_id]["numerics"]["grad_norm"], rel=1e-3)
    # Without clipping the norm is measured in the warm-up steps only (no measured step pays).
    unclipped = records[UNCLIPPED.cell_id]["numerics"]["grad_norm"]
    warmup = UNCLIPPED.warmup_steps
    assert all(v is not None for v in unclipped[:warmup]) and all(v is None for v in unclipped[warmup:])


def test_loss_scaling_keeps_fp16_gradients_out_of_the_subnormals(records):
    """Micikevicius et al. 2018: unscaled, a share of fp16 gradients flushes to zero or
    subnormals; scaled by 2^16 almost none does."""
    for cell in (REFERENCE, DDP, FSDP2):
        g = records[cell.cell_id]["numerics"]["gradient_range"]
        assert g["dtype"] == "float16" and g["loss_scale"] == 2.0**16
        assert g["fraction_zero_or_subnormal_unscaled"] > 0.05
        assert g["fraction_zero_or_subnormal"] < 0.01


def test_cell_page_states_the_numerics(records):
    rows = dict(numerics_rows(records[DDP.cell_id]))
    assert rows["loss scale"] == "65536 to 65536"
    assert rows["steps skipped for overflow"] == "0"
    assert f"clipped to {CLIP:g}" in rows["gradient norm before clipping"]
    assert "without the scale" in rows["gradients zero or subnormal in the compute precision"]


def test_fairscale_sdp_fp16_is_unsupported_here_with_the_reason(records):
    record = records[SDP_FP16.cell_id]
    assert record["status"] == "unsupported" and "ShardedGradScaler" in record["reason"]


def test_real_data_cells_record_their_held_out_loss(records):
    reference, ddp = records[BYTES_REFERENCE.cell_id], records[BYTES_DDP.cell_id]
    assert ddp["status"] == "ok" and ddp["equivalence"]["passed"], ddp["equivalence"]
    evaluation = ddp["evaluation"]
    assert [step for step, _ in evaluation["held_out_loss"]] == [0, 6, 12]
    losses = [loss for _, loss in evaluation["held_out_loss"]]
    assert losses[-1] < losses[0] - 0.5  # bytes are learnable: ln 256 = 5.5 falls fast
    assert losses == pytest.approx([loss for _, loss in reference["evaluation"]["held_out_loss"]], rel=1e-5)
    assert evaluation["data"]["name"] == "stdlib_bytes" and evaluation["data"]["loader_workers"] == 2
    assert records[REFERENCE.cell_id]["evaluation"] is None  # synthetic data: nothing held out
