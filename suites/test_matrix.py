"""One test per cell of the chosen suite (``--suite``), selected with ``-m`` / ``-k``.

A cell passes when it produced a measurement and trained the same model as its
single-process reference. ``unsupported`` (this hardware cannot run it), ``oom`` (it did not
fit) and ``does_not_fit`` (predicted not to, so not launched) are results, reported as skips
with the reason, as is a cell whose reference does not fit (measured, not gated); a crash, a
hang or a different model is a failure.
"""

import pytest


def test_cell(cell, matrix):
    record = matrix.record_of(cell)
    assert record is not None, f"{cell.cell_id}: the runner produced no record"
    if record["status"] in ("unsupported", "oom", "does_not_fit"):
        pytest.skip(f"{record['status']}: {record['reason'].splitlines()[0]}")
    assert record["status"] == "ok", f"{record['status']}: {record['reason']}"
    eq = record["equivalence"]
    if eq is not None and eq["passed"] is None:
        pytest.skip(f"measured, {eq['reason']}")
    if eq is not None:
        assert eq["passed"], (
            f"trains a different model than {eq['reference_cell_id']}: max relative loss"
            f" difference {eq['max_rel_loss_diff']} > tolerance {eq['tolerance']} ({eq['reason']})"
        )
