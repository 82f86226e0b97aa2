"""`adapt run DIR --device cuda` as a GPU user runs it, with no other option, on saved checkpoints.

    PYTHONPATH=$PWD python benchmarks/run_device.py --out DIR                 # on the H200: both shapes
    PYTHONPATH=$PWD python benchmarks/run_device.py --out DIR --tiny --device cpu   # rehearsal on the CPU

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

# Full-size shapes (the public configs' widths) and rehearsal widths for the CPU.
MODELS: dict[str, dict] = {
    "llama-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen2-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
}
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
)


def build_checkpoint(name: str, root: Path, tiny: bool, device: str) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(MODELS[name])
    model_type = fields.pop("model_type")
    if tiny:
        fields.update(TINY)
        fields.pop("rope_scaling", None)
    config = AutoConfig.for_model(model_type, **fields)
    path = root / name
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    return path


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
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_root = Path(os.environ.get("TMPDIR", "/tmp")) / "adapt-run-device"
    results = []
    for name in args.models.split(","):
        checkpoint = build_checkpoint(name, ckpt_root, args.tiny, "cuda" if args.device == "cuda" else "cpu")
        results.append(run_one(name, checkpoint, args.out, args.device, args.budget, args.stages))
    tag = "h200" if args.device == "cuda" else args.device
    (args.out / f"run-{tag}-summary.json").write_text(json.dumps(results, indent=2) + "\n")
    for result in results:
        print(f"{result['model']}: exit {result['exit_code']} in {result['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
