"""Helpers shared by the pipeline tests (imported by the test modules; fixtures live in conftest)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adapt.app.cli import build_parser, main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"


def cli(*argv: str) -> int:
    """Exit code of ``adapt ARGV`` as the shell sees it (argparse errors exit through SystemExit)."""
    try:
        return main(list(argv))
    except SystemExit as exit_:
        return int(exit_.code)


def adapt_run(source: Path, out: Path, *extra: str) -> int:
    return cli("run", str(source), "--out", str(out), "--quiet", *extra)


def load(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def statuses(report: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in report["stages"]}


def leaf_commands() -> dict[str, argparse.ArgumentParser]:
    """Every command's own parser (``report matrix`` and ``report render`` as two), by name."""

    def subparsers(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction]:
        return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]

    leaves = {}
    for name, sub in subparsers(build_parser())[0].choices.items():
        nested = subparsers(sub)
        if nested:
            leaves.update({f"{name} {k}": v for k, v in nested[0].choices.items()})
        else:
            leaves[name] = sub
    return leaves
