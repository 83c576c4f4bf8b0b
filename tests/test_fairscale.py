"""FairScale strategies and the optimizer axis in real 2-rank gloo runs (tests/conftest.py's
shared matrix run): what runs trains the reference's model (the gate passes), FairScale FSDP
is recorded unsupported on CPU, and ShardedDataParallel zeroed the torch 2 way
(set_to_none) trains a different model that the gate catches."""

from __future__ import annotations

import pytest

from harness import faults
from harness.config import CellSpec, StrategySpec


def gpt2(strategy: str, seed: int = 0, **options) -> CellSpec:
    return CellSpec(model="gpt2-tiny", seed=seed, strategy=StrategySpec(name=strategy, **options))


OK_CELLS = [
    gpt2("fairscale_oss"),
    gpt2("fairscale_sdp"),
    gpt2("fairscale_sdp", accumulation=4),  # SDP's no_sync on the accumulation micro-steps
    gpt2("ddp", optimizer="adam8bit"),
    gpt2("ddp", optimizer="adafactor"),
    gpt2("fairscale_sdp", optimizer="adam8bit"),
    gpt2("fairscale_sdp", optimizer="adafactor"),
    gpt2("fsdp1_full", optimizer="adam8bit"),  # flat shards: the quantized-optimizer tolerance
]
FSDP = gpt2("fairscale_fsdp")
# Its own seed so that its cell id differs from the right way's; set_to_none is injected
# through the fault mechanism (harness/faults.py), not a user-visible option.
SDP_SET_TO_NONE = gpt2("fairscale_sdp", seed=1)


# Run in tests/conftest.py's shared_matrix.
MATRIX_CELLS = [*OK_CELLS, FSDP, SDP_SET_TO_NONE]
MATRIX_FAULTS = {SDP_SET_TO_NONE: faults.GRADS_SET_TO_NONE}


@pytest.fixture(scope="module")
def records(shared_matrix) -> dict[str, dict]:
    return shared_matrix.records


@pytest.mark.parametrize("cell", OK_CELLS, ids=lambda c: c.cell_id)
def test_cell_runs_and_trains_the_reference_model(records, cell):
    record = records[cell.cell_id]
    assert record["status"] == "ok", record["reason"]
    eq = record["equivalence"]
    assert eq["passed"], eq
    assert eq["reference_cell_id"] == cell.reference().cell_id


def test_references_use_the_cells_optimizer(records):
    ref = records[gpt2("ddp", optimizer="adam8bit").reference().cell_id]
    assert ref["status"] == "ok" and "adam8bit" in ref["cell_id"]


def test_optimizer_state_is_sharded_and_quantized(records):
    def optimizer_bytes(cell: CellSpec) -> int:
        return records[cell.cell_id]["metrics"]["mem_breakdown_bytes"]["optimizer"]

    full_adamw = records[gpt2("fairscale_sdp").reference().cell_id]["metrics"]["mem_breakdown_bytes"]["optimizer"]
    sdp = optimizer_bytes(gpt2("fairscale_sdp"))
    assert sdp < 0.6 * full_adamw  # OSS: about half of AdamW's state per rank on 2 ranks
    assert optimizer_bytes(gpt2("fairscale_sdp", optimizer="adam8bit")) < 0.5 * sdp
    assert optimizer_bytes(gpt2("ddp", optimizer="adam8bit")) < 0.5 * full_adamw


def test_fairscale_fsdp_is_unsupported_on_cpu(records):
    record = records[FSDP.cell_id]
    assert record["status"] == "unsupported"
    assert "needs CUDA" in record["reason"]


def test_gate_catches_sdp_with_set_to_none_zeroing(records):
    record = records[SDP_SET_TO_NONE.cell_id]
    assert record["status"] == "ok"  # it runs and measures: only the gate can tell
    eq = record["equivalence"]
    assert not eq["passed"] and eq["max_rel_loss_diff"] > 10 * eq["tolerance"], eq
    assert records[gpt2("fairscale_sdp").cell_id]["equivalence"]["passed"]


def test_engine_settings_are_recorded(records):
    """FairScale's defaults and the DDP under OSS, in every rank's record (README "Engine settings")."""
    sdp, oss = records[gpt2("fairscale_sdp").cell_id], records[gpt2("fairscale_oss").cell_id]
    for rank in sdp["per_rank"]:
        # 2**23 elements, capped by FairScale at gpt2-tiny's 134,912.
        assert rank["engine"] == {"name": "fairscale_sdp", "reduce_buffer_size": 2**23,
                                  "reduce_buffer_elements": sdp["model"]["n_params"]}
    assert all(rank["engine"]["bucket_cap_mb"] == 25.0 for rank in oss["per_rank"])
