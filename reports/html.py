"""report.html: one self-contained file (inline CSS, plots as base64 PNG data URIs, no scripts)."""

from __future__ import annotations

import base64
import html
from typing import Any

import pandas as pd

from reports import plots, tables
from reports.agreement import agreement_lines, agreement_table
from reports.markdown import STATUS_MARK, shapes_line
from reports.schema import stage, summary

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1100px;color:#222;
padding:0 1rem}
h1{font-size:1.6rem}h2{border-bottom:1px solid #ddd;padding-bottom:.2rem;margin-top:2rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f5f5f5}td.num{text-align:right;font-variant-numeric:tabular-nums}
.badge{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:600}
.passed{background:#2e7d32}.failed,.error{background:#c62828}.blocked,.interrupted,.incomplete{background:#ef6c00}
.skipped,.pending{background:#9e9e9e}tr.bad td{background:#fdecea}img{max-width:100%;border:1px solid #eee}
.muted{color:#777}code{background:#f5f5f5;padding:0 3px}
"""


def render_html(report: dict[str, Any]) -> str:
    intake = summary(report, "intake")
    title = intake.get("model_class") or report["source"].get("text", "model")
    status = report["status"]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>adapt report: {_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>adapt report: {_e(title)}</h1>",
        f'<p><span class="badge {status}">{_e(STATUS_MARK.get(status, status))}</span> '
        f"exit code {report['exit_code']} · "
        f"source <code>{_e(report['source'].get('text'))}</code> · adapt {_e(report['adapt_version'])} · "
        f"{_e(report['created_utc'])}</p>",
        "<h2>Summary</h2>",
        _stage_table(report),
        f'<p class="muted">{_e(shapes_line(report).replace("`", ""))}</p>',
        "<h2>What is new in this model</h2>",
        *_what_is_new(report),
    ]
    parts += _section(report, "intake", "Model", [tables.model_facts(report), tables.block_groups(report)])
    parts += _section(
        report,
        "operators",
        "Operator mapping",
        [
            tables.coverage_table(report),
            tables.coverage_facts(report),
            tables.operator_table(report),
            agreement_table(report),
        ],
    )
    parts += _section(
        report,
        "plan",
        "Parallel plan",
        [
            tables.plan_layout(report),
            tables.memory_breakdown(report),
            tables.time_breakdown(report),
            tables.ranked_plans(report),
        ],
    )
    parts += _calibrated_plan(report)
    parts += _environment(report)
    parts += _section(report, "alignment", "Alignment", [tables.alignment_table(report)], rows_by_passed=True)
    parts += _section(report, "throughput", "Throughput", [tables.throughput_table(report)])
    parts += _decode(report)
    parts += _section(report, "soak", "Soak", [tables.soak_facts(report)])
    problems = tables.errors_and_notes(report)
    if problems:
        parts += ["<h2>Errors and notes</h2>", _list(problems)]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _what_is_new(report: dict[str, Any]) -> list[str]:
    items, empty = tables.what_is_new(report)
    out = [_list(items) or f"<p>{_e(empty)}</p>"]
    features = tables.known_features(report)
    if features:
        out.append(f"<p>Architecture features (kinds adapt knows): {_e('; '.join(features))}.</p>")
    return out


def _e(value: Any) -> str:
    return html.escape(str(value))


def _list(items: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{_e(i)}</li>" for i in items) + "</ul>" if items else ""


def _stage_table(report: dict[str, Any]) -> str:
    rows = []
    for _, row in tables.stage_table(report).iterrows():
        badge = f'<span class="badge {row["status"]}">{_e(row["status"])}</span>'
        rows.append(
            f"<tr><td>{_e(row['stage'])}</td><td>{badge}</td><td>{_e(row['time'])}</td><td>{_e(row['verdict'])}</td></tr>"
        )
    return "<table><tr><th>stage</th><th>status</th><th>time</th><th>verdict</th></tr>" + "".join(rows) + "</table>"


def _table(df: pd.DataFrame, rows_by_passed: bool = False) -> str:
    if df.empty:
        return ""
    head = "".join(f"<th>{_e(c)}</th>" for c in df.columns)
    body = []
    for row in df.itertuples(index=False):
        cells = []
        for value in row:
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            cells.append(
                f'<td class="num">{_e(tables.format_number(value))}</td>'
                if numeric
                else f"<td>{_e(tables.format_number(value))}</td>"
            )
        bad = rows_by_passed and "passed" in df.columns and not row[list(df.columns).index("passed")]
        body.append(f'<tr class="bad">{"".join(cells)}</tr>' if bad else f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _figure(report: dict[str, Any], name: str) -> str:
    png = plots.FIGURES[name](report)
    if png is None:
        return ""
    data = base64.b64encode(png).decode("ascii")
    return f'<figure><img alt="{_e(name)} plot" data-plot="{_e(name)}" src="data:image/png;base64,{data}"></figure>'


def _section(
    report: dict[str, Any], name: str, title: str, frames: list[pd.DataFrame], rows_by_passed: bool = False
) -> list[str]:
    out = [f"<h2>{_e(title)}</h2>"]
    entry = stage(report, name)
    if not summary(report, name):
        reason = (entry or {}).get("verdict", "")
        return out + [
            f'<p class="muted">No result: stage {_e((entry or {}).get("status", "absent"))}: {_e(reason)}</p>'
        ]
    out.append(f"<p>{_e(entry.get('verdict', ''))}</p>")
    if name == "alignment" and summary(report, name).get("first_divergent"):
        out.append(
            f"<p><strong>First divergent: <code>{_e(summary(report, name)['first_divergent'])}</code></strong></p>"
        )
    if name == "alignment":
        out += [f"<p>{_e(line)}</p>" for line in tables.alignment_extras(report)]
    if name == "plan" and tables.launch_command(report):
        out.append(
            f"<p>Launch (the plan is saved beside this report):</p><pre><code>{_e(tables.launch_command(report))}</code></pre>"
        )
    if name == "throughput":
        out += [f'<p class="caveat">{_e(line)}</p>' for line in tables.throughput_caveats(report)]
    if name == "operators":
        out += [f"<p>{_e(line)}</p>" for line in agreement_lines(report)]
    if name in plots.FIGURES:
        out.append(_figure(report, name))
    out += [_table(df, rows_by_passed) for df in frames]
    for note in summary(report, name).get("notes", []):
        out.append(f'<p class="muted">note: {_e(note)}</p>')
    return out


def _decode(report: dict[str, Any]) -> list[str]:
    """The decode rows of the throughput stage, under their own heading, after the stage's notes."""
    decode = tables.decode_table(report)
    if decode.empty:
        return []
    lines = [f"<p>{_e(line)}</p>" for line in tables.decode_caveats(report)]
    return ["<h3>Decode</h3>", *lines, _table(decode)]


def _calibrated_plan(report: dict[str, Any]) -> list[str]:
    """The plan before and after this machine's measurements, under the plan section."""
    entry = stage(report, "replan")
    if entry is None or entry["status"] in ("skipped", "pending"):
        return []
    out = ["<h3>Before and after calibration</h3>"]
    if not summary(report, "replan"):
        return out + [f'<p class="muted">No result: stage {_e(entry["status"])}: {_e(entry.get("verdict", ""))}</p>']
    out += [f"<p>{_e(line)}</p>" for line in tables.calibration_lines(report)]
    return out + [_table(tables.plan_calibration(report)), _table(tables.calibration_runs(report))]


def _environment(report: dict[str, Any]) -> list[str]:
    env = summary(report, "environment")
    if not env:
        return _section(report, "environment", "Environment", [])
    items = [f"{k}: {tables._cell(v)}" for k, v in (env.get("versions") or {}).items()]
    items += [f"problem: {p}" for p in env.get("problems", [])]
    items += [f"not checked here: {u}" for u in env.get("unchecked", [])]
    return ["<h2>Environment</h2>", _list(items)]
