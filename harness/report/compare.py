"""Render a comparison of two runs (harness/report/compare_stats.py decides it): a text table,
markdown for a pull-request comment, a static HTML page; and ``main_compare``, the body of
``harness compare``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jinja2

from harness.report.compare_stats import (
    ALPHA,
    BETTER,
    MEM_THRESHOLD,
    MIN_SAMPLES,
    MIN_TIME_EFFECT,
    NOT_SIGNIFICANT,
    SAME,
    WORSE,
    CellComparison,
    MetricChange,
    compare_runs,
    parse_thresholds,
    regressions,
)
from harness.results.store import load_run_info

FORMATS = ("text", "markdown", "html")

_MARK_SYMBOL = {BETTER: "✅", WORSE: "❌", NOT_SIGNIFICANT: "➖", SAME: "➖"}


def summary(comparisons: list[CellComparison]) -> str:
    verdicts = [c.verdict for c in comparisons]
    line = (f"{verdicts.count(BETTER)} better, {verdicts.count(WORSE)} worse,"
            f" {verdicts.count(NOT_SIGNIFICANT)} not significant")
    extra = []
    for kind, label in (("only_a", "only in A"), ("only_b", "only in B"), ("not_ok", "not ok in both")):
        n = sum(c.kind == kind for c in comparisons)
        if n:
            extra.append(f"{n} {label}")
    return line + (f" ({', '.join(extra)})" if extra else "")


def _pct(change: float | None) -> str:
    return "n/a" if change is None else f"{change:+.1%}"


def _p(p: float | None) -> str:
    if p is None:
        return ""
    return f"p={p:.1e}" if p < 0.001 else f"p={p:.3f}"


def _cells(c: CellComparison, symbols: bool) -> dict[str, str]:
    """Plain-text pieces of one row, shared by the renderers."""
    def fmt(m: MetricChange | None, with_p: bool = False) -> str:
        if m is None:
            return ""
        mark = _MARK_SYMBOL[m.mark] if symbols else m.mark
        p = _p(m.p_value) if with_p else ""
        note = f"{m.note}" if with_p and m.note == "too few samples" else ""
        extras = ", ".join(x for x in (p, note) if x)
        return f"{_pct(m.change)} {mark}" + (f" ({extras})" if extras else "")

    status = "ok" if c.kind == "compared" else {
        "only_a": f"only in A ({c.status_a})",
        "only_b": f"only in B ({c.status_b})",
    }.get(c.kind, f"{c.status_a} → {c.status_b}")
    verdict = c.verdict
    shown = (_MARK_SYMBOL[verdict] + " " + verdict) if symbols and verdict else verdict
    reason = c.reason_b if c.status_b not in (None, "ok") else c.reason_a
    reason = (reason.strip().splitlines() or [""])[-1][:120]
    return {"cell": c.cell_id, "status": status, "mem": fmt(c.mem), "time": fmt(c.time, with_p=True),
            "throughput": fmt(c.throughput), "verdict": shown, "reason": reason}


_COLUMNS = ("cell", "status", "mem", "time", "throughput", "verdict")
_HEADERS = {"cell": "cell", "status": "status", "mem": "peak mem", "time": "step time",
            "throughput": "throughput", "verdict": "verdict", "reason": "reason"}


def _md_escape(s: str) -> str:
    return (s.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`").replace("\n", " ")
            .replace("<", "&lt;").replace(">", "&gt;"))


def to_markdown(comparisons: list[CellComparison], run_a_name: str = "A", run_b_name: str = "B") -> str:
    lines = [f"**shardbench compare**: `{_md_escape(run_a_name)}` (baseline) → `{_md_escape(run_b_name)}`",
             "",
             "| cell | status | peak mem | step time | throughput | verdict |",
             "|---|---|---|---|---|---|"]
    for c in comparisons:
        row = _cells(c, symbols=True)
        if row["reason"]:
            row["status"] += f": {row['reason']}"
        lines.append("| " + " | ".join(_md_escape(row[k]) for k in _COLUMNS) + " |")
    lines += ["", summary(comparisons), ""]
    return "\n".join(lines)


def to_text(comparisons: list[CellComparison], run_a_name: str = "A", run_b_name: str = "B") -> str:
    rows = [_HEADERS] + [_cells(c, symbols=False) for c in comparisons]
    widths = {k: max(len(r[k]) for r in rows) for k in _COLUMNS}
    lines = [f"compare: {run_a_name} (baseline) -> {run_b_name}"]
    for i, r in enumerate(rows):
        lines.append("  ".join(r[k].ljust(widths[k]) for k in _COLUMNS).rstrip())
        if i == 0:
            lines.append("  ".join("-" * widths[k] for k in _COLUMNS))
    lines.append(summary(comparisons))
    return "\n".join(lines) + "\n"


_HTML = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string("""\
<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>shardbench compare: {{ a }} → {{ b }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.num { text-align: right; white-space: nowrap; }
tr.worse td { background: #fde8e8; }
tr.better td { background: #e8f7e8; }
.reason { color: #666; font-size: 0.85em; }
</style></head><body>
<h1>shardbench compare</h1>
<p>Baseline (A): <code>{{ a }}</code><br>Candidate (B): <code>{{ b }}</code></p>
<p><strong>{{ summary }}</strong></p>
<table>
<thead><tr><th>cell</th><th>status</th><th>peak mem</th>
<th>step time</th><th>throughput</th><th>verdict</th></tr></thead>
<tbody>
{% for row, cls in rows %}<tr class="{{ cls }}"><td>{{ row.cell }}</td><td>{{ row.status }}
{%- if row.reason %}<div class="reason">{{ row.reason }}</div>{% endif %}</td>
<td class="num">{{ row.mem }}</td><td class="num">{{ row.time }}</td>
<td class="num">{{ row.throughput }}</td><td>{{ row.verdict }}</td></tr>
{% endfor %}</tbody></table>
<p class="reason">{{ rule }}</p>
</body></html>
""")

_RULE = ("Step time: slowest rank per step (with --repeat, every trial's steps pooled), two-sided Mann-Whitney U"
         " (normal approximation, tie-corrected),"
         f" marked when p < {ALPHA} and the median ratio differs from 1 by more than {MIN_TIME_EFFECT:.0%};"
         f" fewer than {MIN_SAMPLES} samples per side: not significant. Peak memory: marked when it changes"
         f" by more than {MEM_THRESHOLD:.1%}.")


def to_html(comparisons: list[CellComparison], run_a_name: str, run_b_name: str) -> str:
    rows = [(_cells(c, symbols=True), c.verdict.replace(" ", "-")) for c in comparisons]
    return _HTML.render(a=run_a_name, b=run_b_name, rows=rows, summary=summary(comparisons), rule=_RULE)


def write_html(path: Path, comparisons: list[CellComparison], run_a_name: str, run_b_name: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_html(comparisons, run_a_name, run_b_name), encoding="utf-8")
    return path


def run_name(run_dir: Path) -> str:
    return str(load_run_info(Path(run_dir)).get("run_id") or Path(run_dir).name)


def main_compare(run_a: Path, run_b: Path, fmt: str = "text", fail_on: str | None = None,
                 html_out: Path | None = None, stream=None) -> int:
    """Print the comparison in ``fmt`` (text, markdown, html) to ``stream`` (stdout), and write
    the HTML page to ``html_out`` when given. Returns 1 when ``fail_on`` is given and some cell
    regressed beyond it (see ``regressions``), else 0. Raises ValueError on a bad ``fmt`` or
    ``fail_on`` before reading anything."""
    stream = stream or sys.stdout
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}: choose one of {', '.join(FORMATS)}")
    thresholds = parse_thresholds(fail_on)
    comparisons = compare_runs(run_a, run_b)
    a, b = run_name(run_a), run_name(run_b)
    stream.write({"text": to_text, "markdown": to_markdown, "html": to_html}[fmt](comparisons, a, b))
    if html_out is not None:
        write_html(html_out, comparisons, a, b)
    if fail_on is None:
        return 0
    found = regressions(comparisons, thresholds)
    if found:
        print(f"{len(found)} regression(s) beyond --fail-on {fail_on}:", file=sys.stderr)
        for r in found:
            print(f"  {r.cell_id}: {'; '.join(r.reasons)}", file=sys.stderr)
        return 1
    return 0
