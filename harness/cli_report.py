"""The commands that read recorded runs: ``report`` (a run's HTML report, rebuilt), ``publish``
(reports/ ready for static hosting), ``compare`` (run B against baseline A, cell by cell) and
``accuracy`` (predicted against measured) and ``savings`` (each ZeRO stage's memory against
DDP's, beside the formula)."""

from __future__ import annotations

import argparse
import sys

from harness.cli_common import REPO_ROOT, UsageError, recorded_run


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from harness.report import history, html

    root = args.out or REPO_ROOT
    run_dir = recorded_run(args.out, args.run)
    skipped: list[str] = []
    page = html.write_run_report(run_dir, root / "reports" / run_dir.name, skipped)
    history.write_index(root / "results", root / "reports")
    if skipped:
        print(f"shardbench: skipped {len(skipped)} unreadable item(s) of {run_dir} (warnings above, and in the report)",
              file=sys.stderr)
    print(page)
    return 0


def cmd_publish(args: argparse.Namespace, extra: list[str]) -> int:
    from harness.report import history

    root = args.out or REPO_ROOT
    try:
        page = history.publish(root / "reports", args.destination)
    except ValueError as error:
        raise UsageError(str(error)) from None
    print(page)
    return 0


def cmd_compare(args: argparse.Namespace, extra: list[str]) -> int:
    """Per common cell, B against A: better / worse / not significant; the HTML page goes
    into the report folder beside the runs' own reports."""
    from harness.report import compare, compare_stats

    try:
        compare_stats.parse_thresholds(args.fail_on)
    except ValueError as error:
        raise UsageError(str(error)) from None
    run_a, run_b = (recorded_run(args.out, run) for run in (args.run_a, args.run_b))
    page = (args.out or REPO_ROOT) / "reports" / "compare" / f"{run_a.name}_vs_{run_b.name}.html"
    code = compare.main_compare(run_a, run_b, fmt=args.format, fail_on=args.fail_on, html_out=page)
    print(f"\ncomparison page: {page}", file=sys.stderr)
    return code


def cmd_accuracy(args: argparse.Namespace, extra: list[str]) -> int:
    """Predicted ÷ measured for every measured cell of a run, and the worst per target."""
    from harness.predict import accuracy
    from harness.results.store import load_records

    text, all_met = accuracy.report(load_records(recorded_run(args.out, args.run)))
    print(text)
    return 0 if all_met or not args.strict else 1


def cmd_savings(args: argparse.Namespace, extra: list[str]) -> int:
    """Each sharding's measured memory saving against DDP beside the ZeRO formula's (markdown)."""
    from harness.report import savings
    from harness.results.store import load_records

    print(savings.table(load_records(recorded_run(args.out, args.run))))
    return 0
