"""The versioned ``report.json`` schema: every other report file is rendered from this one object.

Top level (schema_version 1)::

    schema          "adapt.report"
    schema_version  1
    adapt_version   version of adapt that wrote it
    created_utc     ISO-8601 time the report was (re)built
    source          {text, path, fingerprint}
    options         the RunOptions of the run (shapes, cluster, dtype, ...)
    status          passed | failed | interrupted | incomplete
    exit_code       0 passed, 1 a stage or check failed, 2 bad input, 130 interrupted
    stages          list, one per pipeline stage in order:
        name, status (passed|failed|error|blocked|skipped|interrupted|pending), verdict (one line),
        key, duration_s, cached, error, error_kind,
        summary   the normalised fields the tables and plots use (each result type's ``summary()``,
                  judged by ``adapt.core.stage_verdicts``)
        result    the stage's own to_dict(), unchanged
        result_type
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from adapt.core.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, BadInput
from adapt.core.inputs import read_input_text

REPORT_SCHEMA = "adapt.report"
REPORT_SCHEMA_VERSION = 1
EXIT_INTERRUPTED = 130

FAILING = ("failed", "error", "blocked")
STAGE_STATUSES = ("passed", "failed", "error", "blocked", "skipped", "interrupted", "pending")


def overall_status(stages: list[dict[str, Any]]) -> str:
    statuses = [s["status"] for s in stages]
    if "interrupted" in statuses:
        return "interrupted"
    if any(s in FAILING for s in statuses):
        return "failed"
    if "pending" in statuses:
        return "incomplete"
    return "passed"


def exit_code_for(stages: list[dict[str, Any]]) -> int:
    if any(s.get("error_kind") == "BadInput" for s in stages):
        return EXIT_BAD_INPUT
    status = overall_status(stages)
    return {"passed": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(status, EXIT_FAILED)


def build_report(records: list[Any], options: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """Assemble report.json from the stage records (StageRecord or their dicts) of one run."""
    from adapt.core.jsonio import adapt_version, to_jsonable

    stages = [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in records]
    return to_jsonable(
        {
            "schema": REPORT_SCHEMA,
            "schema_version": REPORT_SCHEMA_VERSION,
            "adapt_version": adapt_version(),
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "source": source,
            "options": options,
            "status": overall_status(stages),
            "exit_code": exit_code_for(stages),
            "stages": stages,
        }
    )


def validate_report(data: Any, origin: str = "report") -> dict[str, Any]:
    """Check that ``data`` is a report this version can read; BadInput (exit 2) otherwise."""
    if not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA:
        raise BadInput(f'{origin}: not an adapt report (missing "schema": "{REPORT_SCHEMA}")')
    version = data.get("schema_version")
    if version != REPORT_SCHEMA_VERSION:
        raise BadInput(f"{origin}: report schema version {version}, this adapt reads version {REPORT_SCHEMA_VERSION}")
    stages = data.get("stages")
    if not isinstance(stages, list) or not all(isinstance(s, dict) and "name" in s and "status" in s for s in stages):
        raise BadInput(f'{origin}: "stages" must be a list of {{name, status, ...}} objects')
    for entry in stages:
        name = entry["name"]
        if not isinstance(name, str) or entry["status"] not in STAGE_STATUSES:
            raise BadInput(
                f"{origin}: stage {name!r} has status {entry['status']!r}; allowed: {', '.join(STAGE_STATUSES)}"
            )
        for part in ("summary", "result"):
            if entry.get(part) is not None and not isinstance(entry[part], dict):
                raise BadInput(f"{origin}: stage {name!r}: {part} is a {type(entry[part]).__name__}, not an object")
    return data


def load_report(path: str | Path) -> dict[str, Any]:
    """Read report.json from a file, or from a run directory that holds one."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    if not path.is_file():
        raise BadInput(f"{path}: no such report file")
    try:
        data = json.loads(read_input_text(path))
    except json.JSONDecodeError as err:
        raise BadInput(f"{path}: not valid JSON ({err})") from err
    return validate_report(data, str(path))


def stage(report: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The stage entry ``name`` of a report, or None when the report has no such stage."""
    return next((s for s in report["stages"] if s["name"] == name), None)


def summary(report: dict[str, Any], name: str) -> dict[str, Any]:
    """The normalised summary of stage ``name`` when it produced a result, else ``{}``."""
    entry = stage(report, name)
    if entry is None or entry.get("status") not in ("passed", "failed"):
        return {}
    return entry.get("summary") or {}
