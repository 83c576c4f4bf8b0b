import math

from harness import equivalence
from harness.config import CellSpec, StrategySpec


def cell(**strategy) -> CellSpec:
    return CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp", **strategy))


def test_tolerances_by_precision_and_compression():
    assert equivalence.tolerance(cell()) == equivalence.TOLERANCE_FP32
    assert equivalence.tolerance(cell(precision="bf16")) == equivalence.TOLERANCE_LOW_PRECISION
    assert equivalence.tolerance(cell(compression="fp16")) == equivalence.TOLERANCE_LOW_PRECISION
    assert equivalence.TOLERANCE_FP32 < equivalence.TOLERANCE_QUANTIZED_OPTIMIZER < equivalence.TOLERANCE_LOW_PRECISION
    # Lossy compression is not gated at all: judged where training ends (convergence suite).
    ungated = equivalence.check(cell(compression="powersgd"), [1.0], None)
    assert ungated["passed"] is None and "changes the update by design" in ungated["reason"]


def test_max_rel_diff():
    assert equivalence.max_rel_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert math.isclose(equivalence.max_rel_diff([1.0, 2.2], [1.0, 2.0]), 0.1)
    assert equivalence.max_rel_diff([1.0], [1.0, 2.0]) == math.inf
    assert equivalence.max_rel_diff([float("nan")], [1.0]) == math.inf


def test_check_passes_within_and_fails_beyond_tolerance():
    c = cell()
    ref = {"status": "ok", "losses": [6.0, 5.0]}
    ok = equivalence.check(c, [6.0, 5.0 * (1 + 5e-6)], ref)
    assert ok["passed"] and ok["reference_cell_id"] == c.reference().cell_id
    bad = equivalence.check(c, [6.0, 5.0 * (1 + 5e-5)], ref)
    assert not bad["passed"] and math.isclose(bad["max_rel_loss_diff"], 5e-5, rel_tol=1e-6)


def test_check_fails_without_a_usable_reference():
    c = cell()
    assert equivalence.check(c, [1.0], None)["reason"] == "reference run is missing"
    failed = equivalence.check(c, [1.0], {"status": "failed", "losses": []})
    assert not failed["passed"] and "failed" in failed["reason"]
