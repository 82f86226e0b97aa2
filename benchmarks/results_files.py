"""A benchmark's results file pair: ``NAME.json`` (the figures) and ``NAME.md`` (a short table rendered from them).

Every GPU benchmark writes both from one dict, and can render the table again from a saved JSON without a GPU."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapt.core.jsonio import atomic_write_text

Render = Callable[[dict[str, Any]], str]


def write_results(path: str | Path, results: dict[str, Any], render: Render) -> str:
    """Write ``results`` to ``path`` (JSON) and its table beside it (``.md``), each whole or not at all (a benchmark
    killed at its time limit leaves the last complete pair); returns the table."""
    path = Path(path)
    atomic_write_text(path, json.dumps(results, indent=1))
    table = render(results)
    atomic_write_text(path.with_suffix(".md"), table)
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
