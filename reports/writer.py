"""Writes every report file from one report.json object, each atomically."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FORMATS = ("json", "md", "html", "junit")


def write_reports(report: dict[str, Any], out_dir: str | Path, formats: Iterable[str] = FORMATS) -> dict[str, Path]:
    """Render ``report`` into ``out_dir``; returns format -> path."""
    from adapt.core.jsonio import atomic_write_text
    from reports.html import render_html
    from reports.junit import render_junit
    from reports.markdown import render_markdown

    renderers = {
        "json": ("report.json", lambda r: json.dumps(r, indent=2) + "\n"),
        "md": ("report.md", render_markdown),
        "html": ("report.html", render_html),
        "junit": ("junit.xml", render_junit),
    }
    written = {}
    for fmt in formats:
        name, render = renderers[fmt]
        written[fmt] = atomic_write_text(Path(out_dir) / name, render(report))
    return written
