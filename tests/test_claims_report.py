"""The run report's Claims section, from a synthetic claims.jsonl: one row per claim (the
last record of a claim wins, a truncated last line is skipped), every column shown, strings
escaped, verdicts marked; no section without claims.jsonl; a claims run's cell pages give a
command that reruns a claim reading the cell."""

from __future__ import annotations

import re

import pytest

from harness.claims import records
from harness.claims.base import cell
from harness.report import html
from test_report import XSS, write_synthetic_run  # tests/ is on sys.path (rootdir conftest)


def _claim(claim_id: str, verdict: str, **over) -> dict:
    record = {
        "claim_id": claim_id, "title": f"title of {claim_id}", "source": "Rajbhandari et al. 2020 (ZeRO) §7",
        "published": "ZeRO-3 3Ψ = 1.5× DDP", "formula": "volume(cell) / volume(DDP)", "unit": "× DDP",
        "predicted": 1.5, "measured": 1.5, "ratio": 1.0, "tolerance": "±2%", "verdict": verdict,
        "reason": "", "explained": False, "cell_failed": False, "world_size": 2, "cells": [], "details": {},
    }
    return record | over


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("claims-report")
    run_dir = root / "results" / "run"
    write_synthetic_run(run_dir)
    for record in (
        _claim("comm_volume/fsdp_full", "does not hold", measured=9.0, ratio=6.0),  # superseded below
        _claim("comm_volume/fsdp_full", "holds"),
        _claim("model_states/deepspeed_zero3", "does not hold", unit="bytes", predicted=1349176.0,
               measured=1619980.0, ratio=1.2007, explained=True, reason=f"bucket not in the formula {XSS}"),
        _claim("activations/selective", "not measurable here", unit="bytes", predicted=None, measured=412940.0,
               ratio=None, reason="different policies"),
    ):
        records.append_record(run_dir, record)
    with (run_dir / "claims.jsonl").open("a") as f:
        f.write('{"claim_id": "trunc')  # a writer killed mid-line
    return html.write_run_report(run_dir, root / "reports" / "run").read_text()


def _section(page: str) -> str:
    return page[page.index('<h2 id="claims">'):page.index('<h2 id="cells">')]


def test_one_row_per_claim_with_every_column(report):
    section = _section(report)
    assert '<a href="#claims">Claims</a>' in report
    rows = re.findall(r'<tr class="claim" data-verdict="([^"]+)" data-claim="([^"]+)">', section)
    assert rows == [("holds", "comm_volume/fsdp_full"), ("does not hold", "model_states/deepspeed_zero3"),
                    ("not measurable here", "activations/selective")]
    for text in ("Rajbhandari et al. 2020 (ZeRO) §7", "ZeRO-3 3Ψ = 1.5× DDP", "volume(cell) / volume(DDP)",
                 "1,349,176 B", "1,619,980 B", "1.201", "±2%", "different policies", "(explained)",
                 "3 claims: 1 holds, 1 does not hold, 1 not measurable here."):
        assert text in section, text
    assert "6.000" not in section  # the superseded record of the same claim
    # ... and summed up at the top of the page, before the findings.
    summary = report[report.index('<p id="claims-summary">'):]
    assert report.index('<p id="claims-summary">') < report.index('<section id="findings">')
    assert summary[:summary.index("</p>")].count("</span>") == 3 and '<span class="good">1 holds</span>' in summary


def test_verdicts_marked_and_strings_escaped(report):
    section = _section(report)
    assert '<span class="good">holds</span>' in section
    assert '<span class="bad">does not hold</span>' in section
    assert '<span class="na">not measurable here</span>' in section
    assert XSS not in report and "&lt;script&gt;alert(1)&lt;/script&gt;" in section


def test_no_claims_section_without_claims_jsonl(tmp_path):
    write_synthetic_run(tmp_path / "results" / "run")
    page = html.write_run_report(tmp_path / "results" / "run", tmp_path / "reports" / "run").read_text()
    assert '<h2 id="claims">' not in page and 'href="#claims"' not in page and "claims-summary" not in page


def test_load_records_keeps_the_last_record_of_each_claim(tmp_path):
    records.append_record(tmp_path, _claim("a", "holds"))
    records.append_record(tmp_path, _claim("b", "holds"))
    records.append_record(tmp_path, _claim("a", "does not hold"))
    (tmp_path / "claims.jsonl").open("a").write("{not json")
    assert [(r["claim_id"], r["verdict"]) for r in records.load_records(tmp_path)] == [("a", "does not hold"),
                                                                                    ("b", "holds")]
    assert records.load_records(tmp_path / "missing") == []


def test_a_claim_appended_after_a_cut_line_is_kept(tmp_path):
    records.append_record(tmp_path, _claim("a", "holds"))
    (tmp_path / "claims.jsonl").open("a").write('{"claim_id": "cu')  # a writer killed mid-line
    records.append_record(tmp_path, _claim("b", "holds"))
    assert [r["claim_id"] for r in records.load_records(tmp_path)] == ["a", "b"]


def test_cell_of_a_claims_run_is_rerun_through_a_claim_that_reads_it():
    info = {"suite": "claims", "world_size": 2, "device": {"type": "cpu"}}
    zero1 = cell("zero1", 2)
    assert html.reproduce_command({"cell_id": zero1.cell_id}, info).endswith("-k 'test_claim[model_states/zero1]'")
    ref = cell("ddp", 2, optimizer="adafactor").reference()  # a reference: its distributed cell's claim
    assert "test_claim[optimizer/adafactor_factored]" in html.reproduce_command({"cell_id": ref.cell_id}, info)
    assert "test_cell[" in html.reproduce_command({"cell_id": zero1.cell_id}, info | {"suite": "default"})
