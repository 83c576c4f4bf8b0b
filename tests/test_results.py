import dataclasses
import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from harness import markers
from harness.config import CellSpec, StrategySpec
from harness.measure.memory import BREAKDOWN_KEYS
from harness.measure.summary import summarize
from harness.results import schema
from harness.results import store as store_module
from harness.results.store import (
    DamagedResultsWarning,
    ResultsNotWritable,
    RunStore,
    load_records,
    load_run_info,
    resolve_run,
)

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
    for cell, status in ((CELL, "ok"), (OTHER, "failed")):
        store.append(schema.make_record(cell, markers=[], status=status))
    with store.cells_path.open("a") as f:
        f.write('{"schema_version": 1, "cell_id": "cut mid-wri')  # a writer killed mid-line
    with pytest.warns(DamagedResultsWarning, match="cells.jsonl:3: skipped"):
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


# --- damaged results: skipped with a warning naming file and line, never a crash ---------

def _line(status: str, cell: CellSpec = CELL, **fields) -> str:
    return json.dumps({**schema.make_record(cell, markers=[], status=status), **fields})


OTHER = CellSpec(model="llama-tiny", strategy=StrategySpec(name="ddp"))

DAMAGE = [
    # (id, lines of cells.jsonl, statuses read, numbers of the lines skipped)
    ("truncated-last", [_line("ok"), _line("failed", OTHER), '{"schema_version": 1, "cell_id": "cu'],
     ["ok", "failed"], [3]),
    ("truncated-middle", [_line("ok"), '{"schema_version": 1, "cell_id": "cu', _line("failed", OTHER)],
     ["ok", "failed"], [2]),
    ("garbage-first", ["\x00\x00\x00 not json", _line("ok")], ["ok"], [1]),
    ("newer-version", [_line("ok"), _line("failed", OTHER, schema_version=99)], ["ok"], [2]),
    ("no-version", [_line("ok", schema_version=None)], [], [1]),
    ("not-a-record", ["[1, 2]", '{"status": "ok"}', _line("ok")], ["ok"], [1, 2]),
    ("no-migration", [_line("ok", schema_version=0)], [], [1]),
    ("retried-cell", [_line("failed"), _line("ok", OTHER), _line("ok")], ["ok", "ok"], []),  # last record wins
    ("blank-lines", ["", _line("ok"), "   "], ["ok"], []),
]


@pytest.mark.parametrize("lines, statuses, bad", [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_loader_skips_what_it_cannot_read_and_names_the_line(tmp_path, recwarn, lines, statuses, bad):
    (tmp_path / "cells.jsonl").write_text("\n".join(lines) + "\n")
    skipped: list[str] = []
    records = load_records(tmp_path, skipped)
    assert [r["status"] for r in records] == statuses
    assert all(r["schema_version"] == schema.SCHEMA_VERSION for r in records)
    assert len({r["cell_id"] for r in records}) == len(records)
    assert [s.split(": skipped")[0] for s in skipped] == [f"{tmp_path / 'cells.jsonl'}:{n}" for n in bad]
    warned = [str(w.message) for w in recwarn if issubclass(w.category, DamagedResultsWarning)]
    assert warned == skipped


@pytest.mark.parametrize("content, message", [
    (None, "run.json: missing"),
    ("{not json", "run.json: unreadable"),
    ("[1]", "run.json: not a JSON object"),
    ('{"run_id": "r"}', None),
], ids=["missing", "corrupt", "not-an-object", "fine"])
def test_run_info_loader_warns_and_returns_what_it_can(tmp_path, recwarn, content, message):
    if content is not None:
        (tmp_path / "run.json").write_text(content)
    skipped: list[str] = []
    info = load_run_info(tmp_path, skipped)
    assert info == ({"run_id": "r"} if message is None else {})
    assert [message in s for s in skipped] == ([] if message is None else [True])
    assert len([w for w in recwarn if issubclass(w.category, DamagedResultsWarning)]) == len(skipped)


def test_migrations_run_step_by_step_from_version_0(monkeypatch):
    # A synthetic chain 0 -> 1 -> 2 -> 3 (the released chain starts at 1).
    trail = []

    def step(n):
        def apply(record):
            trail.append(n)
            return {**record, f"field_{n + 1}": record.get(f"field_{n}", 0) + 1}
        return apply

    monkeypatch.setattr(schema, "SCHEMA_VERSION", 3)
    monkeypatch.setattr(schema, "MIGRATIONS", {})
    for n in (2, 0, 1):  # registration order does not matter
        schema.migration(n)(step(n))
    old = {"schema_version": 0, "cell_id": "c", "status": "ok", "field_0": 10}
    new = schema.migrate(old)
    assert trail == [0, 1, 2] and new["schema_version"] == 3 and new["field_3"] == 13
    assert old["schema_version"] == 0  # the given record is untouched
    assert schema.migrate(new) is new  # current: as it is
    with pytest.raises(ValueError, match="already registered"):
        schema.migration(0)(step(0))
    with pytest.raises(schema.UnreadableRecord, match="schema_version=4 is newer"):
        schema.migrate({"schema_version": 4})


def test_a_registered_migration_is_used_by_the_loader(tmp_path, monkeypatch):
    def rename(record):  # a version-0 field renamed in version 1
        return {**{k: v for k, v in record.items() if k != "seconds"}, "wall_s": record["seconds"]}

    monkeypatch.setitem(schema.MIGRATIONS, 0, rename)
    (tmp_path / "cells.jsonl").write_text(_line("ok", schema_version=0, seconds=1.5) + "\n")
    [record] = load_records(tmp_path)  # 0 -> 1 (the synthetic step) -> 2 (the released one)
    assert record["schema_version"] == schema.SCHEMA_VERSION and record["wall_s"] == 1.5 and "seconds" not in record
    assert record["trial"] == 0


def test_every_released_version_has_a_migration_and_version_1_reads_as_trial_0_at_its_own_length(tmp_path):
    assert sorted(schema.MIGRATIONS) == list(range(1, schema.SCHEMA_VERSION))
    current = schema.make_record(CELL, markers=[], status="ok")
    version_1 = {k: v for k, v in current.items() if k not in ("trial", "fit")}  # fit: version 4, never checked
    version_1["cell"] = {k: v for k, v in current["cell"].items() if k != "seq_len"}
    version_1["schema_version"] = 1
    (tmp_path / "cells.jsonl").write_text(json.dumps(version_1) + "\n")
    [record] = load_records(tmp_path)
    assert record == {**current, "schema_version": schema.SCHEMA_VERSION, "trial": 0}
    assert CellSpec.from_dict(record["cell"]) == CELL


def test_loader_keeps_every_trial_and_the_last_record_of_each(tmp_path, recwarn):
    lines = [_line("ok", trial=0), _line("ok", OTHER, trial=0), _line("failed", trial=1, reason="cut"),
             _line("ok", OTHER, trial=1), _line("ok", trial=1), _line("ok", trial="2"), _line("ok", trial=-1)]
    (tmp_path / "cells.jsonl").write_text("\n".join(lines) + "\n")
    skipped: list[str] = []
    records = load_records(tmp_path, skipped)
    # (cell, trial) in order of first record; the retried trial 1 of CELL replaced by its later record
    assert [(r["cell_id"], r["trial"], r["status"]) for r in records] == [
        (CELL.cell_id, 0, "ok"), (OTHER.cell_id, 0, "ok"), (CELL.cell_id, 1, "ok"), (OTHER.cell_id, 1, "ok")]
    assert [s.split(": skipped, ")[1] for s in skipped] == [
        "trial='2' is not a trial number (0, 1, ...)", "trial=-1 is not a trial number (0, 1, ...)"]


def test_an_append_after_a_cut_line_starts_a_line_of_its_own(tmp_path):
    store = RunStore(tmp_path / "results", "run")
    store.append(schema.make_record(CELL, markers=[], status="ok"))
    with store.cells_path.open("a") as f:
        f.write('{"schema_version": 1, "cell_id": "cu')  # killed mid-write
    store.append(schema.make_record(OTHER, markers=[], status="failed"))
    with pytest.warns(DamagedResultsWarning, match=r"cells.jsonl:2: skipped"):
        assert [r["status"] for r in load_records(store.path)] == ["ok", "failed"]


def test_report_of_a_damaged_folder_succeeds_and_counts_what_it_skipped(tmp_path, capsys):
    from harness import cli

    run_dir = tmp_path / "results" / "run-x"  # no run.json, three unreadable lines
    run_dir.mkdir(parents=True)
    lines = [_line("unsupported", reason="why"), "garbage", _line("failed", OTHER, reason="boom"),
             _line("ok", schema_version=99), '{"cut']
    (run_dir / "cells.jsonl").write_text("\n".join(lines))
    with pytest.warns(DamagedResultsWarning):
        assert cli.main(["report", "run-x", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "skipped 4 unreadable item(s)" in err  # 3 lines and the missing run.json
    page = (tmp_path / "reports" / "run-x" / "index.html").read_text()
    assert "4 unreadable items skipped" in page and "cells.jsonl:4" in page


def _record(seed: str) -> dict:
    return schema.make_record(CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"), seed=ord(seed)),
                              markers=[], status="ok")


def test_a_write_that_fails_mid_record_leaves_only_whole_records(tmp_path, monkeypatch):
    store = RunStore(tmp_path, "run")
    store.append(_record("a"))
    before = store.cells_path.read_bytes()
    real_write = os.write

    def half_then_full(fd, data):  # the disk fills halfway through the record
        if len(data) > 100:
            return real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_module.os, "write", half_then_full)
    full = re.escape(f"cannot write {store.cells_path}: No space left on device")
    with pytest.raises(ResultsNotWritable, match=full):
        store.append(_record("b"))
    assert store.cells_path.read_bytes() == before  # the half record cut away
    monkeypatch.undo()
    store.append(_record("c"))  # space again: the next record follows on a line of its own
    assert [r["cell_id"] for r in load_records(store.path)] == [_record("a")["cell_id"], _record("c")["cell_id"]]


def test_a_vanished_folder_and_an_unwritable_run_json_name_their_path(tmp_path, monkeypatch):
    store = RunStore(tmp_path, "run")
    store.write_run_info({"run_id": "run"})
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "write_text", read_only)
    with pytest.raises(ResultsNotWritable, match=r"cannot write .*run\.json: Read-only"):
        store.write_run_info({"run_id": "run", "resumes": []})
    monkeypatch.undo()
    assert json.loads((store.path / "run.json").read_text()) == {"run_id": "run"}  # the one before, whole
    assert sorted(p.name for p in store.path.iterdir()) == ["run.json"]  # no half-written copy left
    store.append(_record("a"))
    shutil.rmtree(store.path)
    with pytest.raises(ResultsNotWritable, match=r"cells\.jsonl: No such file or directory"):
        store.append(_record("b"))
    store.path.mkdir()  # even where something made the folder again: its records are gone
    with pytest.raises(ResultsNotWritable, match=r"cells\.jsonl: No such file or directory"):
        store.append(_record("b"))


PIPELINE = CellSpec(model="llama-tiny", strategy=StrategySpec(name="pp_1f1b", pp_microbatches=8), world_size=4)


def _rank(rank: int, peak: int, held: int, sent: int) -> dict:
    """One rank's raw numbers (training.run_cell's), as far as summarize reads them."""
    return {"rank": rank, "peak_mem_bytes": peak, "mem_breakdown_bytes": dict.fromkeys(BREAKDOWN_KEYS, 0),
            "rss_peak_bytes": None, "step_times_s": [0.1] * 3, "flops_per_sample": 1e6, "tokens_per_sample": 32,
            "at_optimizer_step_bytes": {"params": held, "grads": 0, "optimizer": 2 * held, "activations": 0,
                                        "other": 0},
            "comm_by_op": {"send": {"count": 8, "bytes": sent, "time_s": 0.01}}}


def test_a_pipelines_states_are_its_peak_ranks_its_sends_its_busiest_and_every_other_cells_rank_0s():
    # llama-tiny's 2 blocks on ranks 1 and 2 of 4, sending both ways: the busiest (the lower of
    # two equals); rank 3 peaks (as GPipe's last rank does, every micro-batch's logits held).
    ranks = [_rank(0, peak=100, held=3, sent=1000), _rank(1, peak=200, held=40, sent=2000),
             _rank(2, peak=200, held=40, sent=2000), _rank(3, peak=300, held=5, sent=1000)]
    pipelined = summarize(PIPELINE, ranks, peak_flops_per_rank=None)
    assert pipelined["at_optimizer_step_bytes"] == ranks[3]["at_optimizer_step_bytes"]
    assert (pipelined["comm_bytes_per_step"], pipelined["comm_counted_rank"]) == (2000, 1)
    ddp = summarize(dataclasses.replace(PIPELINE, strategy=StrategySpec(name="ddp")), ranks, peak_flops_per_rank=None)
    assert ddp["at_optimizer_step_bytes"] == ranks[0]["at_optimizer_step_bytes"]  # the least held
    assert (ddp["comm_bytes_per_step"], ddp["comm_counted_rank"]) == (1000, 0)


def test_a_version_4_pipeline_record_takes_its_peak_ranks_states_and_says_whose_sends_it_counted():
    ranks = [_rank(0, peak=100, held=10, sent=1000), _rank(1, peak=300, held=40, sent=2000)]
    current = schema.make_record(PIPELINE, markers=[], status="ok", metrics=summarize(PIPELINE, ranks, None),
                                 per_rank=ranks)
    version_4 = {**current, "schema_version": 4,
                 "metrics": {k: v for k, v in current["metrics"].items() if k != "comm_counted_rank"}}
    version_4["metrics"]["at_optimizer_step_bytes"] = ranks[0]["at_optimizer_step_bytes"]  # the least held
    migrated = schema.migrate(version_4)
    assert migrated["metrics"]["at_optimizer_step_bytes"] == ranks[1]["at_optimizer_step_bytes"]
    assert migrated["metrics"]["comm_counted_rank"] == 0  # rank 0's sends, as they were counted
    unrun = schema.make_record(PIPELINE, markers=[], status="unsupported", reason="why")
    assert schema.migrate({**unrun, "schema_version": 4}) == unrun
