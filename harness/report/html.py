"""A run's static HTML report, built from results/ alone (the report is a pure function of
the results). This release: one table of every cell, failed and unsupported ones included."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2

from harness.results.store import load_records

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("harness.report", "templates"),
    autoescape=True,  # every string from results is escaped
    undefined=jinja2.StrictUndefined,
)


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "" if value is None else f"{value * scale:.{digits}f}"


_ENV.filters.update(mib=_mib, fmt=_fmt)


def write_run_report(run_dir: Path, report_dir: Path) -> Path:
    records = load_records(run_dir)
    info_path = run_dir / "run.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    report_dir.mkdir(parents=True, exist_ok=True)
    page = report_dir / "index.html"
    page.write_text(_ENV.get_template("run.html.j2").render(records=records, info=info, run_dir=run_dir))
    return page
