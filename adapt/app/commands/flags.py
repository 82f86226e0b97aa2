"""Flags every command shares that are not options of a run: ``--json``.

The options themselves (one flag, default and help per quantity) come from the options tree,
``adapt.app.pipeline.options``, through ``adapt.app.options.add_options``.
"""

from __future__ import annotations

import argparse


def add_json(parser: argparse.ArgumentParser, what: str = "the result") -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as exactly one JSON object on stdout")
