"""`adapt run DIR --device cuda` as a GPU user runs it, with no other option, on saved checkpoints.

    PYTHONPATH=$PWD python benchmarks/run_device.py --out DIR                 # on the H200: both shapes
    PYTHONPATH=$PWD python benchmarks/run_device.py --out DIR --tiny --device cpu   # rehearsal on the CPU
    PYTHONPATH=$PWD python benchmarks/run_device.py --out DIR --models llama-1b --fp8  # weights stored as fp8 blocks

Each model is a random-init checkpoint built from its transformers config (bf16, saved with ``save_pretrained``), so
every stage loads it through HF's own loader.  The run itself is the user's command line, in its own process: its exit
code, wall time and verdict lines are recorded, and its report files are copied next to the summary as
``run-<device>-<model>.{json,md}`` (the HTML goes into one tar file to stay within the files a device call returns).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.quantise import quantise_checkpoint_fp8
from benchmarks.shapes import build_checkpoint

MODELS = ("llama-1b", "qwen2-0.5b")  # reference shapes from benchmarks/shapes.py


def run_one(name: str, checkpoint: Path, out: Path, device: str, budget_s: float, stages: str | None) -> dict:
    run_dir = checkpoint.parent / f"adapt-run-{name}"  # beside the checkpoint: only the reports are copied to --out
    command = [sys.executable, "-m", "adapt", "run", str(checkpoint), "--device", device, "--out", str(run_dir)]
    if stages:
        command += ["--stages", stages]
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=budget_s)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, stdout, stderr = None, exc.stdout or "", f"timed out after {budget_s:.0f} s"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    wall = time.perf_counter() - started
    print(stdout[-6000:], stderr[-3000:], sep="\n", flush=True)
    tag = f"run-{'h200' if device == 'cuda' else device}-{name}" + ("-" + stages.replace(",", "-") if stages else "")
    for suffix in ("json", "md"):
        report = run_dir / f"report.{suffix}"
        if report.is_file():
            (out / f"{tag}.{suffix}").write_text(report.read_text())
    if (run_dir / "report.html").is_file():
        with tarfile.open(out / f"{tag}-html.tar.gz", "w:gz") as tar:
            tar.add(run_dir / "report.html", arcname=f"{tag}.html")
    return {
        "model": name,
        "command": " ".join(command[1:]),
        "exit_code": code,
        "wall_s": round(wall, 1),
        "verdict_lines": [ln for ln in stdout.splitlines() if ln[:1] in "✓✗!⏸–…" or "exit" in ln],
        "stderr_tail": stderr[-1000:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="rehearsal widths (CPU)")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds per adapt run")
    parser.add_argument("--stages", help="a subset of stages (default: all, as a user runs it)")
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="store the blocks' linear weights as fp8 blocks first (benchmarks/quantise.py)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_root = Path(os.environ.get("TMPDIR", "/tmp")) / "adapt-run-device"
    results = []
    for name in args.models.split(","):
        device = "cuda" if args.device == "cuda" else "cpu"
        checkpoint = build_checkpoint(name, ckpt_root / name, args.tiny, device)
        if args.fp8:
            quantise_checkpoint_fp8(checkpoint)
            name += "-fp8"
        results.append(run_one(name, checkpoint, args.out, args.device, args.budget, args.stages))
    tag = "h200" if args.device == "cuda" else args.device
    tag += "-fp8" if args.fp8 else ""
    (args.out / f"run-{tag}-summary.json").write_text(json.dumps(results, indent=2) + "\n")
    for result in results:
        print(f"{result['model']}: exit {result['exit_code']} in {result['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
