"""One test per cell of the chosen suite (``--suite``), selected with ``-m`` / ``-k``.

A cell passes when it produced a measurement and trained the same model as its
single-process reference. ``unsupported`` (this hardware cannot run it) and ``oom`` (it does
not fit) are results, reported as skips with the reason; a crash, a hang or a different
model is a failure.
"""

import pytest


def test_cell(cell, matrix):
    record = matrix.record_of(cell)
    assert record is not None, f"{cell.cell_id}: the runner produced no record"
    if record["status"] in ("unsupported", "oom"):
        pytest.skip(f"{record['status']}: {record['reason'].splitlines()[0]}")
    assert record["status"] == "ok", f"{record['status']}: {record['reason']}"
    eq = record["equivalence"]
    if eq is not None:
        assert eq["passed"], (
            f"trains a different model than {eq['reference_cell_id']}: max relative loss"
            f" difference {eq['max_rel_loss_diff']} > tolerance {eq['tolerance']} ({eq['reason']})"
        )
