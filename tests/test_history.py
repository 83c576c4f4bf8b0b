"""reports/index.html across runs, and publish."""

import json

import pytest

from harness.report import history, html
from test_report import write_synthetic_run


def test_index_lists_every_run_and_charts_cells_measured_twice(tmp_path):
    results, reports = tmp_path / "results", tmp_path / "reports"
    ids = write_synthetic_run(results / "20261101-000000-1")
    write_synthetic_run(results / "20261102-000000-2")
    (results / "latest").symlink_to("20261102-000000-2")
    html.write_run_report(results / "20261102-000000-2", reports / "20261102-000000-2")
    page = history.write_index(results, reports).read_text()
    assert page.index("20261102-000000-2") < page.index("20261101-000000-1")  # newest first
    assert 'href="20261102-000000-2/index.html"' in page  # relative link to a built report
    assert 'href="20261101-000000-1/index.html"' not in page  # never a link to a missing page
    assert "latest" not in page
    charts = sorted((reports / "history").glob("*.svg"))
    assert charts and all(c.stat().st_size > 1000 for c in charts)
    assert len(charts) < len(ids)  # only cells ok in both runs get a chart


def test_index_tolerates_null_and_missing_run_info(tmp_path):
    results = tmp_path / "results"
    write_synthetic_run(results / "20261101-000000-1")
    (results / "20261101-000000-1" / "run.json").write_text('{"environment": null, "device": null}')
    write_synthetic_run(results / "20261102-000000-2")
    (results / "20261102-000000-2" / "run.json").unlink()
    page = history.write_index(results, tmp_path / "reports").read_text()
    assert "20261101-000000-1" in page and "20261102-000000-2" in page


def test_index_of_no_runs_still_renders(tmp_path):
    (tmp_path / "results").mkdir()
    page = history.write_index(tmp_path / "results", tmp_path / "reports").read_text()
    assert "No runs in results/ yet." in page


def test_publish_copies_a_self_contained_folder_and_refuses_a_full_one(tmp_path):
    results, reports = tmp_path / "results", tmp_path / "reports"
    write_synthetic_run(results / "20261101-000000-1")
    html.write_run_report(results / "20261101-000000-1", reports / "20261101-000000-1")
    history.write_index(results, reports)
    site = history.publish(reports, tmp_path / "site")
    assert site.read_text() == (reports / "index.html").read_text()
    assert (tmp_path / "site" / "20261101-000000-1" / "index.html").exists()
    with pytest.raises(ValueError, match="not an empty folder"):
        history.publish(reports, tmp_path / "site")
    with pytest.raises(ValueError, match="inside"):
        history.publish(reports, reports / "site")
    with pytest.raises(ValueError, match="no reports at"):
        history.publish(tmp_path / "nothing", tmp_path / "site2")


def test_a_run_with_cells_compare_marks_worse_is_flagged_against_the_run_before_it(tmp_path):
    results, reports = tmp_path / "results", tmp_path / "reports"
    for run in ("20261101-000000-1", "20261102-000000-2", "20261103-000000-3"):
        write_synthetic_run(results / run)
    # The third run's DDP cell held twice the memory: compare marks it worse.
    cells = results / "20261103-000000-3" / "cells.jsonl"
    lines = cells.read_text().splitlines(keepends=True)
    ddp = next(i for i, line in enumerate(lines) if '"gpt2-tiny/ddp/fp32/ckpt_none/mb2/ws2/seed0"' in line)
    record = json.loads(lines[ddp])
    record["metrics"]["peak_mem_bytes"] *= 2
    lines[ddp] = json.dumps(record) + "\n"
    cells.write_text("".join(lines))
    page = history.write_index(results, reports).read_text()
    rows = {run: page[page.index(f">{run}<"):][:page[page.index(f">{run}<"):].index("</tr>")]
            for run in ("20261101-000000-1", "20261102-000000-2", "20261103-000000-3")}
    assert 'class="against"></td>' in rows["20261101-000000-1"]  # nothing before it
    assert "none worse</a> than 20261101-000000-1" in rows["20261102-000000-2"]
    assert '<span class="bad">1 cell worse</span></a> than 20261102-000000-2' in rows["20261103-000000-3"]
    compared = (reports / "compare-20261102-000000-2-20261103-000000-3.html").read_text()
    assert "gpt2-tiny/ddp/fp32/ckpt_none/mb2/ws2/seed0" in compared
