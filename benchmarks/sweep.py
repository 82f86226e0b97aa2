"""Day-0 sweep: every transformers causal LM that builds tiny, through intake, operators and alignment.

For each model type in transformers' causal-LM mapping, a tiny random checkpoint is built with
``save_pretrained`` (in its own subprocess, so a model that hangs or crashes cannot take the sweep
with it) and ``adapt run DIR --stages intake,operators,alignment`` runs on it in another subprocess
with a timeout. One row per architecture: the verdict of each stage and the first error line.

    python benchmarks/sweep.py --out benchmarks/results [--only llama,jamba] [--timeout 300]

Writes ``sweep.json`` and ``sweep.md`` under ``--out``. Subprocesses run one at a time.
The sweep runs before a release, not in CI: CI keeps its own zoo.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root
from benchmarks.sweep_tiny import build

STAGES = ("intake", "operators", "alignment")


def _first_error_line(text: str) -> str:
    """The exception a traceback ends with, on one line (its message may span several: ``ImportError:`` then why)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    tail = lines[frames[-1] + 1 :] if frames else lines[-1:]
    start = next((i for i, line in enumerate(tail) if not line.startswith(" ")), 0)  # past the frame's source line
    return " ".join(line.strip() for line in tail[start:])[:300]


def sweep_one(model_type: str, work: Path, timeout: float) -> dict[str, Any]:
    """Build then run one architecture; never raises."""
    row: dict[str, Any] = {"model_type": model_type, "built": False, "stages": {}, "error": ""}
    directory = work / model_type
    started = time.monotonic()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    try:
        built = subprocess.run(
            [sys.executable, __file__, "--build", model_type, str(directory / "ckpt")],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        row["error"] = "build timed out"
        return row
    if built.returncode != 0:
        row["error"] = "build: " + _first_error_line(built.stderr or built.stdout)
        return row
    row["built"] = True
    row.update(json.loads(built.stdout.strip().splitlines()[-1]))
    run_dir = directory / "run"
    command = [sys.executable, "-m", "adapt", "run", str(directory / "ckpt"), "--stages", ",".join(STAGES)]
    command += ["--out", str(run_dir), "--force", "--quiet"]
    try:
        ran = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        row["exit_code"] = ran.returncode
        stderr = ran.stderr
    except subprocess.TimeoutExpired:
        row["exit_code"] = None
        stderr = "adapt run timed out"
    report = run_dir / "report.json"
    if report.exists():
        for entry in json.loads(report.read_text())["stages"]:
            if entry["name"] in STAGES:
                row["stages"][entry["name"]] = {
                    "status": entry["status"],
                    "verdict": entry.get("verdict", ""),
                    "error": (entry.get("error") or "").strip().splitlines()[-1:] or [""],
                }
                row["stages"][entry["name"]]["error"] = row["stages"][entry["name"]]["error"][0][:300]
    failing = [s for s in STAGES if row["stages"].get(s, {}).get("status") != "passed"]
    if failing and not row["error"]:
        stage = row["stages"].get(failing[0])
        if row["exit_code"] is None:
            row["error"] = f"{failing[0]}: timed out after {timeout:.0f} s"
        elif stage and (stage["error"] or stage["verdict"]):
            row["error"] = f"{failing[0]}: " + (stage["error"] or stage["verdict"])[:300]
        else:
            row["error"] = f"{failing[0]}: " + _first_error_line(stderr)
    row["passed"] = not failing
    row["seconds"] = round(time.monotonic() - started, 1)
    return row


def write_results(rows: list[dict[str, Any]], out: Path, provenance: str = "") -> None:
    """sweep.json (every row) and sweep.md (the pass rate and one line per architecture); ``provenance`` says how
    the rows were made (which types, which code, what was rerun and why), under the title of both."""
    import torch
    import transformers

    built = [r for r in rows if r["built"]]
    passed = [r for r in built if r.get("passed")]
    summary = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": "cpu",
        "dtype": "fp32",
        "architectures": len(rows),
        "built": len(built),
        "passed_all_stages": len(passed),
        "pass_rate": round(len(passed) / len(built), 4) if built else 0.0,
        "per_stage_passed": {s: sum(r["stages"].get(s, {}).get("status") == "passed" for r in built) for s in STAGES},
        "provenance": provenance,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Sweep: every transformers causal LM, tiny, through intake, operators, alignment",
        "",
        f"transformers {summary['transformers']}, torch {summary['torch']}, CPU, fp32. "
        f"**{len(passed)} of {len(built)} buildable architectures pass all three stages "
        f"({100 * summary['pass_rate']:.1f}%)**; {len(rows) - len(built)} do not build tiny. "
        + ", ".join(f"{s} {n}" for s, n in summary["per_stage_passed"].items())
        + ".",
        "",
        *([f"**How these rows were made**: {provenance}", ""] if provenance else []),
        "| model type | intake | operators | alignment | first error |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if not row["built"]:
            cells = ["not built"] * 3
        else:
            cells = [row["stages"].get(s, {}).get("status", "-") for s in STAGES]
        error = row["error"].replace("|", "\\|").replace("\n", " ")[:160]
        name = row["model_type"] + (" (stated config)" if row.get("settings", "").startswith("stated") else "")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {error} |")
    (out / "sweep.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--work", default="/tmp/adapt-sweep")
    parser.add_argument("--only", default="", help="comma list of model types (default: all)")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per subprocess")
    parser.add_argument("--first", default="", help="comma list of model types to run before the others")
    parser.add_argument("--resume", action="store_true", help="keep rows already in --out/sweep.json")
    parser.add_argument(
        "--provenance", default="", help="how the rows were made: which types, which code, what was rerun (written out)"
    )
    parser.add_argument("--build", nargs=2, metavar=("MODEL_TYPE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        build(args.build[0], Path(args.build[1]))
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.only:
        names = [n for n in names if n in set(args.only.split(","))]
    first = [n for n in args.first.split(",") if n in names]
    names = first + [n for n in names if n not in first]
    out = Path(args.out)
    previous: dict[str, dict[str, Any]] = {}
    if args.resume and (out / "sweep.json").exists():
        previous = {r["model_type"]: r for r in json.loads((out / "sweep.json").read_text())["rows"]}
    rows: list[dict[str, Any]] = []
    for index, name in enumerate(names):
        row = previous[name] if name in previous and not args.only else sweep_one(name, Path(args.work), args.timeout)
        rows.append(row)
        mark = "pass" if row.get("passed") else ("skip" if not row["built"] else "FAIL")
        print(f"[{index + 1}/{len(names)}] {name}: {mark} {row['error'][:120]}", flush=True)
        merged = {**previous, **{r["model_type"]: r for r in rows}}
        write_results([merged[k] for k in sorted(merged)], out, args.provenance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
