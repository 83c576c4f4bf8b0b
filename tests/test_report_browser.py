"""The report in a real browser (headless Chromium through Playwright, from file://, no
network): no console or page errors, every figure renders, sorting and filtering work.

Uses the system Chromium (Debian: ``apt-get install -y chromium``); skipped when it is
missing. ``playwright install`` is not needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_report import write_synthetic_run  # tests/ is on sys.path (rootdir conftest, prepend import mode)

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason=f"{CHROMIUM} missing: apt-get update && apt-get install -y chromium")
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]' for playwright")

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def report_page(tmp_path_factory) -> Path:
    from harness.report import html

    root = tmp_path_factory.mktemp("browser")
    write_synthetic_run(root / "results" / "run")
    return html.write_run_report(root / "results" / "run", root / "reports" / "run")


@pytest.fixture
def page(report_page):
    errors: list[str] = []
    requests: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 900})
        pg.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        pg.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
        pg.on("request", lambda r: requests.append(r.url))
        pg.goto(report_page.as_uri())
        pg.wait_for_load_state("load")
        yield pg, errors, requests
        browser.close()


def _rows(pg, visible_only: bool = True) -> list[list[str]]:
    return pg.eval_on_selector_all(
        "#cells-table tbody tr",
        "(rows, vis) => rows.filter(r => !vis || !r.hidden)"
        ".map(r => Array.from(r.cells).map(c => c.getAttribute('data-v')))",
        visible_only)


def _figures_render(pg) -> None:
    sizes = pg.eval_on_selector_all("img", "imgs => imgs.map(i => [i.getAttribute('src'), i.complete, i.naturalWidth])")
    assert sizes, "no figures on the page"
    for src, complete, width in sizes:
        assert complete and width > 0, f"figure {src} did not render"


def test_loads_without_errors_and_figures_render(page, report_page, tmp_path):
    pg, errors, requests = page
    _figures_render(pg)
    assert errors == []
    assert all(url.startswith("file://") for url in requests), requests
    shot = tmp_path / "report.png"
    pg.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")


def test_the_first_screen_shows_the_findings_not_the_table(page):
    pg, errors, _ = page
    first_screen = "(el) => { const r = el.getBoundingClientRect(); return r.top >= 0 && r.top < 900; }"
    assert pg.eval_on_selector("#findings", first_screen)
    assert pg.eval_on_selector("#finding-strategy .sentences li", first_screen)
    assert not pg.eval_on_selector("#cells-table", first_screen)
    assert errors == []


def test_every_cells_figures_page_loads_and_filters_by_model(page):
    pg, errors, _ = page
    pg.locator("#all-figures-link").click()
    pg.wait_for_load_state("load")
    _figures_render(pg)
    sections = "els => els.filter(e => !e.hidden).map(e => e.getAttribute('data-model'))"
    assert pg.eval_on_selector_all("section.model-figures", sections) == ["gpt2-tiny", "llama-tiny"]
    pg.select_option("#f-model", "llama-tiny")
    assert pg.eval_on_selector_all("section.model-figures", sections) == ["llama-tiny"]
    pg.select_option("#f-model", "")
    pg.fill("#filter", "pareto")
    visible = "els => els.filter(e => !e.hidden).map(e => e.getAttribute('data-title'))"
    titles = pg.eval_on_selector_all("figure", visible)
    assert titles and all("Pareto" in t for t in titles)
    assert errors == []


def test_click_header_sorts(page):
    pg, errors, _ = page
    col = 3  # peak MiB / rank
    header = pg.locator("#cells-table thead th").nth(col)
    header.click()
    values = [r[col] for r in _rows(pg)]
    numbers = [float(v) for v in values if v]
    assert numbers == sorted(numbers) and len(numbers) >= 3
    assert all(v == "" for v in values[len(numbers):])  # empty (failed) cells last
    header.click()
    numbers_desc = [float(r[col]) for r in _rows(pg) if r[col]]
    assert numbers_desc == sorted(numbers, reverse=True)
    pg.locator("#cells-table thead th").nth(0).click()
    ids = [r[0] for r in _rows(pg)]
    assert ids == sorted(ids, key=lambda s: s.lower()) or ids == sorted(ids)
    assert errors == []


def test_text_filter_and_status_select(page):
    pg, errors, _ = page
    total = len(_rows(pg))
    pg.fill("#filter", "llama")
    visible = _rows(pg)
    assert len(visible) == 1 and visible[0][0].startswith("llama-tiny/")
    pg.fill("#filter", "")
    assert len(_rows(pg)) == total
    pg.select_option("#f-status", "failed")
    visible = _rows(pg)
    assert len(visible) == 1 and visible[0][1] == "failed"
    pg.select_option("#f-status", "")
    pg.select_option("#f-engine", "DeepSpeed")
    assert [r[2] for r in _rows(pg)] == ["DeepSpeed"]
    pg.select_option("#f-engine", "")
    pg.select_option("#f-model", "gpt2-tiny")
    assert len(_rows(pg)) == total - 1
    assert errors == []


def test_cell_page_loads(page, report_page):
    pg, errors, _ = page
    pg.locator("#cells-table tbody tr td.id a").first.click()
    pg.wait_for_load_state("load")
    assert "Reproduce" in pg.content()
    widths = pg.eval_on_selector_all("img", "imgs => imgs.map(i => i.naturalWidth)")
    assert all(w > 0 for w in widths)
    assert errors == []


def _open(report: Path):
    """A fresh browser page on ``report``: (page, errors, dialogs, browser)."""
    errors: list[str] = []
    dialogs: list[str] = []
    p = sync_api.sync_playwright().start()
    browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
    pg = browser.new_page(viewport={"width": 1400, "height": 900})
    pg.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    pg.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    pg.goto(report.as_uri())
    pg.wait_for_load_state("load")
    return pg, errors, dialogs, (browser, p)


def _close(handles) -> None:
    browser, p = handles
    browser.close()
    p.stop()


def test_every_axis_the_default_suite_varies_has_a_finding_and_its_figure(tmp_path):
    from harness import markers, suites
    from harness.report import html
    from harness.results.schema import make_record
    from harness.runner.matrix import with_references

    run_dir = tmp_path / "results" / "run"
    run_dir.mkdir(parents=True)
    cells = suites.cells_of("default", 2)
    records = [make_record(c, markers=markers.markers_of(c), status="ok",
                           metrics={"peak_mem_bytes": 2**20 * (1 + i % 7), "step_time_s": 0.01 * (1 + i % 5),
                                    "tokens_per_s": 1000.0, "comm_bytes_per_step": 2**20})
               for i, c in enumerate(with_references(cells))]
    (run_dir / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = html.write_run_report(run_dir, tmp_path / "reports" / "run")
    pg, errors, _, handles = _open(report)
    try:
        shown = pg.eval_on_selector_all(".finding", "els => els.map(e => e.id)")
        assert shown == [f"finding-{axis}" for axis in (
            "strategy", "tp_plan", "precision", "checkpointing", "offload", "accumulation", "compression",
            "optimizer", "attention", "heads", "model", "micro_batch")]
        _figures_render(pg)
        assert errors == []
    finally:
        _close(handles)


def test_a_suite_file_with_html_in_its_description_and_failed_cells_render_safely(tmp_path):
    from harness.report import html

    run_dir = tmp_path / "results" / "run"
    write_synthetic_run(run_dir)  # a failed cell with markup in its reason, an unsupported one
    info = json.loads((run_dir / "run.json").read_text())
    info.update(suite="mine.toml", suite_file='description = "<img src=x onerror=alert(2)> <b>my</b> suite"\n')
    (run_dir / "run.json").write_text(json.dumps(info))
    report = html.write_run_report(run_dir, tmp_path / "reports" / "run")
    pg, errors, dialogs, handles = _open(report)
    try:
        assert pg.inner_text("#suite-description") == "<img src=x onerror=alert(2)> <b>my</b> suite"
        assert dialogs == [] and errors == []
        statuses = pg.eval_on_selector_all("#cells-table tbody tr", "rows => rows.map(r => r.dataset.status)")
        assert "failed" in statuses and "unsupported" in statuses
    finally:
        _close(handles)
