"""The run report from synthetic results: every cell shown (failed ones with their reason),
figures written as non-empty SVG, every string escaped, nothing fetched from the network."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.config import CellSpec, StrategySpec
from harness.report import figures, html
from harness.results.schema import make_record

XSS = "<script>alert(1)</script>"


def _metrics(peak: int, tokens: float, comm: bool) -> dict:
    return {
        "peak_mem_bytes": peak,
        "mem_breakdown_bytes": {"params": peak // 5, "grads": peak // 5, "optimizer": peak // 5,
                                "activations": peak // 5, "other": peak - 4 * (peak // 5)},
        "rss_peak_bytes": 10 * peak, "step_time_s": 0.01, "step_time_iqr_s": 0.001,
        "samples_per_s": tokens / 32, "tokens_per_s": tokens, "tflops_per_rank": 0.02, "mfu": None,
        "mfu_suspect": False, "comm_time_s_per_step": 0.002 if comm else 0,
        "comm_bytes_per_step": 2**20 if comm else 0,
        "comm_by_op": {"all_reduce": {"count": 1, "bytes": 2**20, "time_s": 0.002, "busbw_gbps": 0.5}} if comm else {},
    }


def _per_rank(world_size: int, peak: int) -> list[dict]:
    return [{"rank": r, "peak_mem_bytes": peak, "mem_breakdown_bytes": {"params": peak}, "rss_peak_bytes": peak,
             "cuda_memory": None, "memory_tracker": "MemTracker", "step_time_s": 0.01, "step_time_iqr_s": 0.001,
             "step_times_s": [0.011, 0.01, 0.009, 0.012], "engine": {}} for r in range(world_size)]


def write_synthetic_run(run_dir: Path) -> list[str]:
    """A run with a reference, equivalent and diverging cells, failed, unsupported, an ok cell
    without metrics and a truncated last line. Returns the cell ids that must appear."""
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({
        "run_id": run_dir.name, "suite": "default", "command": ["harness", "run"], "world_size": 2,
        "marker_expression": "", "keyword_expression": "", "device": {"type": "cpu", "name": None},
        "environment": {"hardware": {"cpu": "Test CPU", "cpu_count": 2, "gpus": []}, "python": "3.11",
                        "platform": "Linux", "versions": {"torch": "2.13.0"},
                        "git": {"commit": "abc123", "dirty": True}, "env": {"NCCL_DEBUG": "INFO"}},
    }))
    ref = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="single"), micro_batch=4, world_size=1)
    ddp = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"))
    z3 = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="fsdp_full"))
    ds3 = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="deepspeed_zero3"))
    llama = CellSpec(model="llama-tiny", strategy=StrategySpec(name="single"), micro_batch=4, world_size=1)
    bad = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp", precision="bf16"))
    unsup = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp", compression="bf16"))
    losses = [6.0, 5.8, 5.5, 5.3]
    eq = {"reference_cell_id": ref.cell_id, "max_rel_loss_diff": 0.0, "tolerance": 1e-5, "passed": True, "reason": ""}
    records = [
        make_record(ref, markers=["single"], status="ok", n_params=1000, metrics=_metrics(4 * 2**20, 2e4, False),
                    per_rank=_per_rank(1, 4 * 2**20), losses=losses, wall_s=0.5),
        make_record(ddp, markers=["ddp"], status="ok", metrics=_metrics(5 * 2**20, 3e4, True),
                    per_rank=_per_rank(2, 5 * 2**20), losses=losses, equivalence=eq, wall_s=0.5),
        make_record(z3, markers=["fsdp"], status="ok", metrics=_metrics(3 * 2**20, 1e4, True),
                    per_rank=_per_rank(2, 3 * 2**20), losses=[6.0, 5.9, 5.7, float("nan")],
                    equivalence={**eq, "max_rel_loss_diff": 0.5, "passed": False, "reason": "diverged"}),
        make_record(ds3, markers=["deepspeed"], status="failed", reason=f"Traceback ...\nRuntimeError: {XSS}"),
        make_record(llama, markers=["single"], status="ok", metrics=_metrics(2**20, 5e4, False),
                    per_rank=_per_rank(1, 2**20), losses=losses),
        make_record(bad, markers=["ddp"], status="ok"),  # ok, but no metrics at all
        make_record(unsup, markers=["ddp"], status="unsupported", reason="bf16_compress_hook requires NCCL"),
    ]
    lines = [json.dumps(r) for r in records]
    (run_dir / "cells.jsonl").write_text("\n".join(lines) + '\n{"schema_version": 1, "cell_id": "trunc')
    return [r["cell_id"] for r in records]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("report")
    ids = write_synthetic_run(root / "results" / "20260101-000000-1")
    page = html.write_run_report(root / "results" / "20260101-000000-1", root / "reports" / "20260101-000000-1")
    return page, ids


def test_index_lists_every_cell_with_reasons(report):
    page, ids = report
    text = page.read_text()
    for cell_id in ids:
        assert cell_id in text
    assert "bf16_compress_hook requires NCCL" in text
    assert "trunc" not in text  # the truncated last line is skipped, not shown half-parsed
    assert "1 unreadable item skipped" in text and "cells.jsonl:8: skipped" in text  # ... and counted
    cells = text[text.index('id="cells-table"'):text.index('id="figures"')]
    assert cells.count('<tr class="failed"') == 1 and cells.count('<tr class="unsupported"') == 1


def test_findings_come_first_with_their_figure(report):
    page, _ = report
    text = page.read_text()
    findings = text[text.index('<section id="findings">'):text.index("</section>")]
    assert text.index('<section id="findings">') < text.index('id="cells-table"')
    # fsdp_full and ddp differ in the strategy alone (the failed ZeRO-3 cell has no numbers).
    assert 'id="finding-strategy"' in findings and "fsdp_full (ZeRO-3) held 0.60× ddp&#39;s peak per rank" in findings
    assert "deepspeed_zero3" not in findings
    assert '<img src="figures/findings-strategy.svg"' in findings


def test_predicted_beside_measured_per_predictor_with_its_target(tmp_path):
    run_dir = tmp_path / "results" / "r"
    run_dir.mkdir(parents=True)

    def ratios(peak: float, step: float) -> dict:
        return {"analytic_peak": {"ratio": peak, "within_target": abs(peak - 1) <= 0.1, "off": "activations: low"},
                "step_time": {"ratio": step, "within_target": abs(step - 1) <= 0.5, "off": None}}

    records = [make_record(CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=name)), markers=[name], status="ok",
                           metrics=_metrics(5 * 2**20, 3e4, True),
                           predicted={"analytic": {"unavailable": "not modelled"},
                                      "traced": {"unavailable": "not traced"},
                                      "step_time": {"unavailable": "not priced"}, "ratios": ratios(peak, step)})
               for name, peak, step in (("ddp", 1.02, 1.1), ("fsdp_full", 0.8, 0.9))]
    (run_dir / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = html.write_run_report(run_dir, tmp_path / "reports" / "r").read_text()
    section = text[text.index('<section id="accuracy">'):]
    section = section[:section.index("</section>")]
    peak = section[section.index('data-target="analytic_peak"'):]
    peak = peak[:peak.index("</tr>")]
    assert "±10%" in peak and "1 of 2" in peak and "0.800" in peak and "missed" in peak
    assert "gpt2-tiny/fsdp_full/" in peak and "activations: low" in peak
    step = section[section.index('data-target="step_time"'):]
    assert "±50%" in step and "2 of 2" in step and ">met<" in step[:step.index("</tr>")]
    assert (tmp_path / "reports" / "r" / "figures" / "accuracy.svg").stat().st_size > 1000


def test_the_guide_takes_no_cell_that_failed_the_gate(report):
    page, _ = report
    text = page.read_text()
    section = text[text.index('<section id="guide">'):]
    section = section[:section.index("</section>")]
    assert 'data-model="gpt2-tiny" data-world-size="2"' in section and "ddp/fp32/ckpt_none/mb2/ws2/seed0" in section
    assert "fsdp_full" not in section  # smaller, but it trains another model (the gate failed)


def test_strings_from_results_are_escaped(report):
    page, _ = report
    for path in [page, *page.parent.glob("cells/*.html")]:
        text = path.read_text()
        assert XSS not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.read_text()


def test_figures_are_nonempty_svg_referenced_relatively(report):
    page, _ = report
    # The run's page draws the findings' axes; every cell's charts are on a page of their own.
    run_srcs = re.findall(r'<img src="([^"]+)"', page.read_text())
    assert run_srcs and all(Path(s).stem.startswith("findings-") for s in run_srcs)
    assert 'href="figures.html"' in page.read_text()
    srcs = re.findall(r'<img src="([^"]+)"', (page.parent / "figures.html").read_text())
    for src in run_srcs + srcs:
        assert src.startswith("figures/") and src.endswith(".svg")
        svg = (page.parent / src).read_text()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg and len(svg) > 1000
    # Faceted by model: the two models never share a figure.
    assert any("gpt2-tiny" in s for s in srcs) and any("llama-tiny" in s for s in srcs)
    assert {"memory", "throughput", "pareto", "comm", "loss", "steptime"} <= {Path(s).stem.split("-")[0] for s in srcs}


def test_cell_pages(report):
    page, ids = report
    for cell_id in ids:
        cell_page = page.parent / "cells" / html.cell_page_name(cell_id)
        text = cell_page.read_text()
        assert cell_id in text and "../index.html" in text
        assert html.reproduce_command({"cell_id": cell_id}, {"suite": "default", "world_size": 2,
                                                             "device": {"type": "cpu"}}) in text.replace("&#39;", "'")
    ddp = (page.parent / "cells" / html.cell_page_name(ids[1])).read_text()
    loss_svg = re.search(r'<img src="(\.\./figures/cells/[^"]+\.svg)"', ddp).group(1)
    assert (page.parent / "cells" / loss_svg).stat().st_size > 1000
    assert "NCCL_DEBUG" in ddp and "abc123" in ddp


def test_engines_table_groups_one_zero_idea(report):
    text = report[0].read_text()
    engines = text[text.index('id="engines"'):text.index('id="environment"')]
    assert "zero3 · gpt2-tiny · fp32 · ws2" in engines
    assert "DeepSpeed" in engines and "PyTorch" in engines


def test_self_contained(report):
    page, _ = report
    for path in [page, *page.parent.glob("cells/*.html")]:
        text = path.read_text()
        assert not re.search(r'<(script|link|img)[^>]+(src|href)="(https?:)?//', text)
        assert "@import" not in text


def test_reproduce_command_selects_exactly_one_cell():
    command = html.reproduce_command({"cell_id": "gpt2-tiny/ddp/fp32/ckpt_none/mb2/ws2/seed0"},
                                     {"suite": "default", "world_size": 2, "device": {"type": "cpu"}})
    assert command == ("./run_all.sh --suite default --gpus 2 --device cpu"
                       " -k 'test_cell[gpt2-tiny/ddp/fp32/ckpt_none/mb2/ws2/seed0]'")


def test_run_without_ok_cells_or_run_json_renders(tmp_path):
    run_dir = tmp_path / "results" / "r"
    run_dir.mkdir(parents=True)
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"))
    record = make_record(cell, markers=[], status="timeout", reason="hung")
    (run_dir / "cells.jsonl").write_text(json.dumps(record) + "\n")
    page = html.write_run_report(run_dir, tmp_path / "reports" / "r")
    text = page.read_text()
    assert cell.cell_id in text and "hung" in text and "No figures" in text


def test_old_records_without_optional_fields_render(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"))
    record = make_record(cell, markers=[], status="ok", metrics=_metrics(2**20, 1e4, False), losses=[1.0, 0.9])
    for key in ("zero_idea", "wall_s", "per_rank"):
        record.pop(key)
    record["metrics"].pop("comm_by_op")
    record["metrics"].pop("mfu")
    (run_dir / "cells.jsonl").write_text(json.dumps(record) + "\n")
    (run_dir / "run.json").write_text("{}")
    text = html.write_run_report(run_dir, tmp_path / "rep").read_text()
    assert cell.cell_id in text and "zero_idea" in text  # the engines section says why it is empty


def test_pareto_front():
    import pandas as pd

    df = pd.DataFrame({"peak_mib": [1, 2, 3, 4], "tokens_per_s": [10, 5, 20, 15], "label": list("abcd")})
    assert list(figures.pareto_front(df)["label"]) == ["a", "c"]


def test_a_run_with_trials_shows_medians_spread_and_each_trial(tmp_path):
    run_dir = tmp_path / "results" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r", "suite": "default", "world_size": 2, "repeat": 3}))
    ddp = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"))
    flaky = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="fsdp_full"))
    lines = []
    for trial, step in enumerate((0.010, 0.014, 0.012)):  # rounds: every cell's trial t before any t + 1
        lines.append(make_record(ddp, markers=[], status="ok", metrics={**_metrics(2**20, 1e4, False),
                                                                         "step_time_s": step},
                                 per_rank=_per_rank(2, 2**20), losses=[1.0, 0.9], trial=trial, wall_s=0.5))
        lines.append(make_record(flaky, markers=[], status="timeout" if trial == 1 else "ok", reason="hung",
                                 metrics={} if trial == 1 else _metrics(2**20, 1e4, False), trial=trial))
    (run_dir / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    page = html.write_run_report(run_dir, tmp_path / "reports" / "r")
    text = page.read_text()
    cells = text[text.index('id="cells-table"'):text.index('id="figures"')]
    assert cells.count('<tr class="ok"') == 1 and cells.count('<tr class="timeout"') == 1  # one row per cell
    assert "<td data-v=\"0.012\">12.00 ± 1.00</td>" in text  # the median trial's step time
    assert "trials · spread · peak" in text and "3 · 33.3% · same" in text  # (14 - 10) / 12
    assert "2 of 3 trials ok; trial 1: hung" in text
    cell_page = (page.parent / "cells" / html.cell_page_name(ddp.cell_id)).read_text()
    trials_table = cell_page[cell_page.index('id="trials-table"'):]
    assert re.findall(r'<td>([^<]*)</td>\s*<td class="status l">(\w+)</td><td>([^<]*)</td>', trials_table) == [
        ("0", "ok", "10.00"), ("1", "ok", "14.00"), ("2 (shown)", "ok", "12.00")]
    assert "--repeat 3" in cell_page  # the command that reproduces the run's statistics


def test_the_same_results_give_the_same_bytes(tmp_path):
    """Figures drawn in parallel worker processes (figures.render) and pages rendered twice:
    every file of the report identical."""
    run_dir = tmp_path / "results" / "20260101-000000-1"
    write_synthetic_run(run_dir)
    first, second = tmp_path / "a", tmp_path / "b"
    html.write_run_report(run_dir, first)
    html.write_run_report(run_dir, second)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    assert len([f for f in files if f.suffix == ".svg"]) > 10
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_a_cuda_cells_page_gives_the_nsight_systems_command_for_the_same_cell():
    record = {"cell_id": "gpt2-tiny/ddp/bf16/ckpt_none/mb2/ws2/seed0", "world_size": 2,
              "per_rank": [{"rank": 0, "profile_trace": "profiles/gpt2-tiny_ddp/rank0.trace.json"}]}
    info = {"suite": "default", "world_size": 2, "device": {"type": "cuda"}}
    profile = html._profile(record, info, "r1")
    assert profile["traces"] == [(0, "../../../results/r1/profiles/gpt2-tiny_ddp/rank0.trace.json")]
    assert profile["nsys"].startswith("nsys profile -o nsys-gpt2_tiny_ddp_bf16_ckpt_none_mb2_ws2_seed0 --trace=cuda")
    assert profile["nsys"].endswith(html.reproduce_command(record, info))
    assert html._profile(record, {**info, "device": {"type": "cpu"}}, "r1")["nsys"] is None
