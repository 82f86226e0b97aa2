"""A benchmark's results file pair: ``NAME.json`` (the figures) and ``NAME.md`` (a short table rendered from them).

Every GPU benchmark writes both from one dict, and can render the table again from a saved JSON without a GPU."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Render = Callable[[dict[str, Any]], str]


def write_results(path: str | Path, results: dict[str, Any], render: Render) -> str:
    """Write ``results`` to ``path`` (JSON) and its table beside it (``.md``); returns the table."""
    path = Path(path)
    path.write_text(json.dumps(results, indent=1))
    table = render(results)
    path.with_suffix(".md").write_text(table)
    return table


def rerender_if_asked(argv: list[str], render: Render) -> bool:
    """``--render OUT.json``: the table again from the saved figures (no GPU).  True when it was asked."""
    if argv[:1] != ["--render"]:
        return False
    if len(argv) < 2:
        sys.exit("--render needs the results JSON to render")
    path = Path(argv[1])
    path.with_suffix(".md").write_text(render(json.loads(path.read_text())))
    return True
