"""``adapt gate report.json [--thresholds FILE]``: re-judge a finished run for CI, without rerunning it."""

from __future__ import annotations

import argparse
import json

from adapt.app.options import add_options
from adapt.app.pipeline.options import ValidationOptions
from adapt.core.errors import EXIT_FAILED, EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "gate",
        help="re-judge a finished report against stricter or looser thresholds (exit 0 pass, 1 fail, 2 bad input)",
    )
    p.add_argument("report", help="report.json (or the run directory holding it)")
    add_options(p, ValidationOptions, only=("thresholds",))
    p.add_argument("--junit", help="also write the gate's checks as JUnit XML to this file")
    p.add_argument("--json", action="store_true", help="print the gate result as one JSON object")
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from adapt.core.jsonio import atomic_write_text
    from reports import load_report
    from reports.judge import load_thresholds, rejudge, render_gate_junit

    report = load_report(args.report)
    result = rejudge(report, load_thresholds(args.thresholds))
    if args.junit:
        atomic_write_text(args.junit, render_gate_junit(report, result))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        failed = [c for c in result.checks if not c.passed]
        for check in failed:
            print(f"FAIL {check.stage}: {check.name}: {check.detail}")
        if result.first_divergent:
            print(f"first divergent: {result.first_divergent}")
        print(
            f"{'PASS' if result.passed else 'FAIL'}: "
            f"{len(result.checks) - len(failed)}/{len(result.checks)} checks passed"
        )
    return EXIT_OK if result.passed else EXIT_FAILED
