"""Where a cold operators stage's seconds go on the device: every cache empty, one fresh process per setting.

``benchmarks/e2e.py`` measures the stage cold with only adapt's timing cache emptied, so its first model pays
for Triton's and Inductor's empty caches as well and the models after it do not.  This script empties all three
(``ADAPT_CACHE``, ``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``) for every run, runs intake and ``run_ops``
as ``adapt run`` does, and splits the plan phase by component kind (``KernelPlan.seconds_by_kind``), so that a setting meant to cut the
first compile's cost (Inductor's compile workers, say) is measured against the default on equal terms.

    PYTHONPATH=$PWD python benchmarks/ops_cold.py --out DIR [--models llama-1b,qwen3-moe] [--settings default] [--warm]

Writes ``ops-cold-h200.{json,md}`` (``ops-cold-cpu`` without CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.results_files import rerender_if_asked, write_results
from benchmarks.shapes import SHAPES, build_checkpoint

# setting -> environment it adds to the run
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "threads1": {"TORCHINDUCTOR_COMPILE_THREADS": "1"},  # Inductor compiles in process: no worker pool to start
}

_RUN = """
import json, logging, sys, time
start = time.perf_counter()
events = []  # the self-tests' and the candidate timings' own seconds, from their debug log lines
handler = logging.Handler()
handler.emit = lambda record: events.append(record.getMessage())
for name in ("operators.benchmark", "operators.providers.adapt_triton"):
    logging.getLogger(name).addHandler(handler)
    logging.getLogger(name).setLevel(logging.DEBUG)
import torch
import torch._inductor.config as inductor_config
from adapt.model.intake import build_spec, resolve_source
from operators import run_ops

imports = time.perf_counter() - start
source = resolve_source(sys.argv[1])
spec = build_spec(source)
intake = time.perf_counter() - start - imports
began = time.perf_counter()
report = run_ops(source, out_dir=sys.argv[2], spec=spec)  # as the pipeline's operators stage calls it
print(json.dumps({"imports_s": imports, "intake_s": intake, "ops_s": time.perf_counter() - began,
                  "phases": report.phases, "plan_seconds_by_kind": report.plan.seconds_by_kind,
                  "compile_threads": inductor_config.compile_threads, "events": events}))
"""


def _caches(work: Path, model: str, setting: str) -> dict[str, Path]:
    return {
        name: work / model / setting / name for name in ("ADAPT_CACHE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
    }


def run_cold(checkpoint: Path, model: str, setting: str, work: Path) -> dict[str, Any]:
    """One run in a fresh process with every cache empty."""
    caches = _caches(work, model, setting)
    if any(path.exists() for path in caches.values()):
        raise RuntimeError(f"{model}/{setting}: its caches are not empty, so the run would not be cold")
    return {"model": model, "caches": "cold", **_run(checkpoint, setting, caches)}


def run_warm(checkpoint: Path, model: str, setting: str, work: Path) -> dict[str, Any]:
    """A second fresh process on the caches ``run_cold`` filled: what a user's next run of the model waits."""
    return {"model": model, "caches": "warm", **_run(checkpoint, setting, _caches(work, model, setting))}


def _run(checkpoint: Path, setting: str, caches: dict[str, Path]) -> dict[str, Any]:
    env = dict(os.environ, **{k: str(v) for k, v in caches.items()}, **SETTINGS[setting])
    env.update(TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1")
    with tempfile.TemporaryDirectory() as artifacts:  # the run's own directory: model.onnx, generated kernels
        done = subprocess.run(
            [sys.executable, "-c", _RUN, str(checkpoint), artifacts], env=env, capture_output=True, text=True
        )
    if done.returncode:
        return {"setting": setting, "error": done.stderr.strip().splitlines()[-1][:300] if done.stderr else "failed"}
    return {"setting": setting, **json.loads(done.stdout.strip().splitlines()[-1])}


def _commit() -> str:
    """The checkout's commit, where git can tell (a copied working tree may have no repository)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def _plan_seconds(run: dict[str, Any]) -> dict[str, float]:
    """Where the plan phase's seconds went, by component kind (``KernelPlan.seconds_by_kind``).  Runs saved before
    plans recorded it timed the candidates' ``measure`` calls instead; those are summed by kind."""
    if "plan_seconds_by_kind" in run:
        return run["plan_seconds_by_kind"]
    by_kind: dict[str, float] = {}
    for m in run.get("measured", []):
        by_kind[m["kind"]] = by_kind.get(m["kind"], 0.0) + m["seconds"]
    return by_kind


def render(result: dict[str, Any]) -> str:
    lines = [
        f"# Operators stage, cold and warm ({result['device']})",
        "",
        "Intake then `run_ops` as `adapt run` runs them (ONNX export and patch check included since 2026-12-04; "
        "earlier rows ran without them), each in a fresh process. "
        "Cold: adapt's, Triton's and Inductor's caches all empty; warm: the next run on the caches the cold run "
        "filled. Seconds. Target (issue 14): under 30 s cold, under 5 s warm.",
        "",
        "| commit | model | caches | setting | compile threads | imports | intake | operators stage | plan phase "
        "| ONNX export | patch check | plan s by kind |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in result["runs"]:
        model, caches = run.get("model", result.get("model", "?")), run.get("caches", "cold")
        head = f"| {run.get('commit', '?')} | {model} | {caches} | {run['setting']} "
        if "error" in run:
            lines.append(head + f"| failed: {run['error']} | | | | | | | |")
            continue
        timed = "; ".join(f"{kind} {t:.1f}" for kind, t in _plan_seconds(run).items() if t >= 0.1)
        lines.append(
            head + f"| {run['compile_threads']} | {run['imports_s']:.1f} | {run['intake_s']:.1f} | "
            f"{run['ops_s']:.1f} | {run['phases'].get('plan', 0.0):.1f} | {_phase(run, 'onnx')} | "
            f"{_phase(run, 'patch_check')} | {timed or 'none'} |"
        )
    detailed = [run for run in result["runs"] if run.get("events")]
    if detailed:
        lines += ["", "## Self-tests and timed candidates that took 0.5 s or more (compile included)", ""]
        for run in detailed:
            slow = [e for e in run["events"] if _event_seconds(e) >= 0.5]
            lines.append(
                f"- {run['model']} ({run['caches']}, {run['setting']}): " + ("; ".join(slow) if slow else "none")
            )
    lines += ["", *(f"- {note}" for note in result.get("notes", []))] if result.get("notes") else []
    return "\n".join(lines) + "\n"


def _phase(run: dict[str, Any], name: str) -> str:
    """A phase's seconds, or "–" for rows measured before the stage ran it."""
    return f"{run['phases'][name]:.1f}" if name in run["phases"] else "–"


def _event_seconds(event: str) -> float:
    """The seconds a self-test or candidate log line reports (``...: 1.23 s ...``)."""
    try:
        return float(event.split(": ", 1)[1].split(" s", 1)[0])
    except (IndexError, ValueError):
        return 0.0


def _kept(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """An earlier results file's runs, each naming its model (files of one model named it once, at the top), and
    its notes."""
    earlier = json.loads(path.read_text())
    runs = [{"model": earlier.get("model", "?"), "caches": "cold", **run} for run in earlier["runs"]]
    return runs, earlier.get("notes", [])


def main() -> int:
    if rerender_if_asked(sys.argv[1:], render):
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="llama-1b", help=f"comma list of {', '.join(sorted(SHAPES))}")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {', '.join(SETTINGS)}")
    parser.add_argument("--warm", action="store_true", help="after each cold run, a warm one on the caches it filled")
    parser.add_argument("--keep", help="an earlier results JSON whose runs go first in this one")
    parser.add_argument("--tiny", action="store_true", help="rehearsal widths on the CPU")
    args = parser.parse_args()
    models = args.models.split(",")
    if unknown := sorted(set(models) - set(SHAPES)):
        parser.error(f"unknown model {', '.join(unknown)}; known: {', '.join(sorted(SHAPES))}")
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    runs, notes = _kept(Path(args.keep)) if args.keep else ([], [])
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "cpu_count": os.cpu_count(), "runs": runs}
    result["notes"] = notes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("ops-cold-h200.json" if cuda else "ops-cold-cpu.json")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in models:
            checkpoint = build_checkpoint(model, work / model / "checkpoint", args.tiny, "cuda" if cuda else "cpu")
            for setting in args.settings.split(","):
                runs.append({"commit": _commit(), **run_cold(checkpoint, model, setting, work)})
                if args.warm:
                    runs.append({"commit": _commit(), **run_warm(checkpoint, model, setting, work)})
                print(write_results(path, result, render))  # after every model and setting: a time limit keeps them
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
