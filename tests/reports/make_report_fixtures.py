"""Regenerate tests/reports/data/*.report.json from real ``adapt run`` runs (all stages, CPU).

    python tests/reports/make_report_fixtures.py

Run it when a stage's output format changes; the report tests then render these real outputs.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from adapt.app.cli import main
from adapt.model.zoo import build_tiny_checkpoint

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "tiny-llama"


def main_() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sources = {
            "tiny-llama": (EXAMPLE, []),
            "qwen3_moe": (build_tiny_checkpoint("qwen3_moe", tmp / "qwen3_moe"), []),
            "custom": (build_tiny_checkpoint("custom", tmp / "custom"), ["--trust-remote-code"]),
        }
        for name, (source, extra) in sources.items():
            out = tmp / f"run-{name}"
            code = main(["run", str(source), "--out", str(out), "--quiet", *extra])
            shutil.copy2(out / "report.json", HERE / "data" / f"{name}.report.json")
            print(f"{name}: exit {code}")


if __name__ == "__main__":
    main_()
