"""Compatibility matrix over several runs: models × stages, coverage and speedup (like vLLM's table)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import pandas as pd

from reports.schema import stage, summary
from reports.tables import format_number, to_markdown

MARKS = {
    "passed": "✅",
    "failed": "❌",
    "error": "💥",
    "blocked": "⛔",
    "skipped": "–",
    "pending": "…",
    "interrupted": "⏸",
}


def build_matrix(reports: list[dict[str, Any]]) -> pd.DataFrame:
    stage_names = list(dict.fromkeys(entry["name"] for report in reports for entry in report["stages"]))
    rows = []
    for report in reports:
        intake = summary(report, "intake")
        row: dict[str, Any] = {
            "model": _model_name(report["source"].get("text", "")),
            "architecture": ", ".join(intake.get("architectures", [])) or "",
            "params": intake.get("params_total"),
        }
        for name in stage_names:  # the columns come from the reports themselves
            entry = stage(report, name)
            row[name] = MARKS.get(entry["status"], entry["status"]) if entry else ""
        row["coverage"] = _coverage(report)
        row["speedup"] = _speedup(report)
        row["first divergent"] = summary(report, "alignment").get("first_divergent") or ""
        row["verdict"] = report["status"]
        rows.append(row)
    return pd.DataFrame(rows)


def _model_name(text: str) -> str:
    """A hub id as typed; a local path by its directory name (the matrix is read by people, not scripts)."""
    return Path(text.rstrip("/")).name if text.startswith(("/", ".", "~")) else text


def _coverage(report: dict[str, Any]) -> str:
    """Share of components on fused or native kernels, and the FLOP shares (fast, recognised) the operators stage gives."""
    ops = summary(report, "operators")
    counts = ops.get("status_counts", {})
    total = sum(counts.values())
    if not total:
        return ""
    fast = counts.get("fused", 0) + counts.get("native", 0)
    text = f"{fast}/{total} fused+native"
    share, known = ops.get("fast_flop_share"), ops.get("recognised_flop_share")
    if isinstance(share, (int, float)):
        text += f" ({100 * share:.0f}% FLOPs" + (
            f", {100 * known:.0f}% recognised)" if isinstance(known, float) else ")"
        )
    return text


def _speedup(report: dict[str, Any]) -> str:
    rows = summary(report, "throughput").get("rows", [])
    parts = [
        f"{r.get('metric')} ×{r['speedup']:.2f}"
        for r in rows
        if r.get("unit") == "tokens/s" and isinstance(r.get("speedup"), (int, float))
    ]
    return ", ".join(parts)


def render_matrix_markdown(df: pd.DataFrame) -> str:
    legend = " · ".join(f"{mark} {status}" for status, mark in MARKS.items())
    return "# adapt compatibility matrix\n\n" + to_markdown(df) + f"\n{legend}\n"


def render_matrix_html(df: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(format_number(v))}</td>" for v in row) + "</tr>"
        for row in df.itertuples(index=False)
    )
    legend = " · ".join(f"{mark} {status}" for status, mark in MARKS.items())
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>adapt compatibility matrix</title><style>'
        "body{font:14px system-ui,sans-serif;margin:2rem}table{border-collapse:collapse}"
        "th,td{border:1px solid #ddd;padding:4px 8px}th{background:#f5f5f5}</style></head><body>"
        f"<h1>adapt compatibility matrix</h1><table><tr>{head}</tr>{body}</table>"
        f"<p>{html.escape(legend)}</p></body></html>\n"
    )
