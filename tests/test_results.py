import json

import pytest

from harness import markers
from harness.config import CellSpec, StrategySpec
from harness.results import schema
from harness.results.store import RunStore, load_records, resolve_run

CELL = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"))


def test_record_has_the_documented_fields():
    record = schema.make_record(CELL, markers=markers.markers_of(CELL), status="unsupported", reason="why")
    for key in ("schema_version", "cell_id", "status", "reason", "markers", "world_size", "model", "strategy",
                "precision", "metrics", "per_rank", "losses", "equivalence"):
        assert key in record
    assert record["model"] == {"name": "gpt2-tiny", "n_params": None, "attn_implementation": None}
    assert record["strategy"]["name"] == "ddp" and record["schema_version"] == schema.SCHEMA_VERSION
    json.dumps(record)  # serialisable as it is
    with pytest.raises(ValueError, match="status='crashed'"):
        schema.make_record(CELL, markers=[], status="crashed")


def test_store_appends_links_latest_and_survives_a_truncated_line(tmp_path):
    store = RunStore(tmp_path / "results", "run-a")
    store.write_run_info({"run_id": "run-a"})
    for status in ("ok", "failed"):
        store.append(schema.make_record(CELL, markers=[], status=status))
    with store.cells_path.open("a") as f:
        f.write('{"schema_version": 1, "cell_id": "cut mid-wri')  # a writer killed mid-line
    records = load_records(store.path)
    assert [r["status"] for r in records] == ["ok", "failed"]
    assert (tmp_path / "results" / "latest").resolve() == store.path.resolve()
    RunStore(tmp_path / "results", "run-b")
    assert (tmp_path / "results" / "latest").resolve().name == "run-b"
    assert resolve_run(tmp_path / "results", "run-a") == store.path.resolve()
    with pytest.raises(ValueError, match="no run at"):
        resolve_run(tmp_path / "results", "run-zzz")


def test_unknown_schema_version_is_refused():
    with pytest.raises(ValueError, match="schema_version=99"):
        schema.migrate({"schema_version": 99})


def test_non_finite_losses_are_written_as_null_and_fail_the_gate():
    from harness import equivalence

    record = schema.make_record(CELL, markers=[], status="ok", losses=[6.0, float("nan"), float("inf")])
    assert record["losses"] == [6.0, None, None]
    json.dumps(record, allow_nan=False)
    assert equivalence.max_rel_diff(record["losses"], [6.0, 6.0, 6.0]) == float("inf")
