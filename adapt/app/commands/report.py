"""``adapt report``: re-render a run's reports, or build the compatibility matrix over several runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adapt.app.commands.flags import add_json
from adapt.core.errors import BadInput


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="render reports from report.json (matrix over several runs)")
    sub = p.add_subparsers(dest="report_command", metavar="KIND")
    m = sub.add_parser("matrix", help="compatibility matrix (models × stages, coverage, speedup) in Markdown and HTML")
    m.add_argument("run_dirs", nargs="+", help="run directories (or report.json files) of `adapt run`")
    m.add_argument("--out", default="matrix", help="output path stem: writes STEM.md and STEM.html (default: matrix)")
    add_json(m, "the matrix rows and the files written")
    m.set_defaults(func=handle_matrix)
    r = sub.add_parser("render", help="rewrite report.md, report.html and junit.xml from a run's report.json")
    r.add_argument("run_dir", help="run directory (or its report.json)")
    add_json(r, "the files written")
    r.set_defaults(func=handle_render)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def handle_matrix(args: argparse.Namespace) -> int:
    from adapt.core.jsonio import atomic_write_text
    from reports import load_report
    from reports.matrix import build_matrix, render_matrix_html, render_matrix_markdown

    reports = [load_report(path) for path in args.run_dirs]
    df = build_matrix(reports)
    stem = Path(args.out)
    if stem.suffix in (".md", ".html"):
        stem = stem.with_suffix("")
    md = atomic_write_text(stem.with_suffix(".md"), render_matrix_markdown(df))
    page = atomic_write_text(stem.with_suffix(".html"), render_matrix_html(df))
    if args.json:
        rows = json.loads(df.to_json(orient="records"))
        _emit_json({"rows": rows, "written": {"md": str(md), "html": str(page)}})
        return 0
    print(render_matrix_markdown(df))
    print(f"wrote {md} and {page}")
    return 0


def handle_render(args: argparse.Namespace) -> int:
    from reports import load_report, write_reports

    path = Path(args.run_dir)
    out_dir = path if path.is_dir() else path.parent
    if not out_dir.exists():
        raise BadInput(f"{path}: no such run directory")
    written = write_reports(load_report(path), out_dir, formats=("md", "html", "junit"))
    if args.json:
        _emit_json({"written": {fmt: str(p) for fmt, p in written.items()}})
    else:
        print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


def _emit_json(data: dict) -> None:
    json.dump(data, sys.stdout)
    sys.stdout.write("\n")
