"""The claim record: ``evaluate`` makes one from a claim's judge and a run's cell records,
``append_record`` appends it to results/<run_id>/claims.jsonl through harness.results.store (as
cells.jsonl is appended), ``load_records`` reads them back for the report, ``format_value``
prints a value for a table. Its fields are in README "Claims"."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from harness.claims.base import NotMeasurable, Outcome, Readings
from harness.claims.catalogue import CLAIMS
from harness.config import CellSpec
from harness.results import store

CLAIMS_FILE = "claims.jsonl"


def evaluate(claim_id: str, record_of: Callable[[CellSpec], dict | None], world_size: int) -> dict:
    """The claim record of one claim from a run's cell records. A claim that cannot be measured
    is "not measurable here" (``cell_failed`` when a cell crashed rather than could not run); one
    that does not hold for a reason written down (``Claim.deviation``) gives that reason and is
    ``explained``."""
    claim = CLAIMS[claim_id]
    failed = False
    try:
        outcome = claim.judge(Readings(record_of, world_size))
    except NotMeasurable as why:
        outcome = Outcome(predicted=None, measured=None, verdict="not measurable here", reason=str(why))
        failed = why.failed
    reason = outcome.reason
    if outcome.verdict == "does not hold" and claim.deviation:
        reason = f"{claim.deviation} ({outcome.reason})" if outcome.reason else claim.deviation
    ratio = outcome.ratio
    return {
        "claim_id": claim.claim_id,
        "title": claim.title,
        "source": claim.source,
        "published": claim.published,
        "formula": claim.formula,
        "unit": claim.unit,
        "predicted": outcome.predicted,
        "measured": outcome.measured,
        "ratio": None if ratio is None or not math.isfinite(ratio) else ratio,
        "tolerance": claim.tolerance,
        "verdict": outcome.verdict,
        "reason": reason,
        "explained": bool(claim.deviation) and outcome.verdict == "does not hold",
        "cell_failed": failed,
        "world_size": world_size,
        "cells": [c.cell_id for c in claim.cells(world_size)],
        "details": outcome.details,
    }


def append_record(run_dir: Path, record: dict) -> None:
    """One line per claim, written as RunStore writes cells (a killed writer's cut last line
    stays on its own)."""
    store.append_json_line(run_dir / CLAIMS_FILE, record, default=float)


def load_records(run_dir: Path) -> list[dict]:
    """Every complete claim record of a run (the last per claim id); a truncated last line
    (a killed writer) is skipped."""
    path = run_dir / CLAIMS_FILE
    if not path.exists():
        return []
    out: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "claim_id" in record:
            out[record["claim_id"]] = record
    return list(out.values())


def format_value(value, unit: str) -> str:
    """A claim's predicted or measured value for a table."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if unit == "bytes":
        return f"{value:,.0f} B"
    if unit == "entries":
        return f"{value:.0f}"
    if unit == "value":
        return f"{value:.4g}"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.4g}"
