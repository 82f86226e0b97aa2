"""The operators stage cold and warm on this machine: where its seconds go, with adapt's caches empty and then filled.

Builds a random-init checkpoint of a public shape scaled to fit a CPU (Qwen3-MoE layout: 2 layers, width 1024,
64 experts top-8), then runs ``run_ops`` on it in fresh processes: once with an empty ``ADAPT_CACHE`` (cold: every
numeric probe runs) and then twice more on the cache that run left (warm: probe verdicts, kernel self-tests and
timings come from disk).  Writes ``ops-stage-cpu.{json,md}`` with each run's phases.  The ONNX export and the patch
check are left out: neither is cached, and both scale with the model rather than with what is new in it.

    python benchmarks/ops_stage_cpu.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_RUN = """
import json, sys, time
from operators.api import run_ops
start = time.perf_counter()
report = run_ops(sys.argv[1], onnx=False, check_patch=False)
print(json.dumps({"seconds": time.perf_counter() - start, "phases": report.phases}))
"""


def build(directory: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=1024, moe_intermediate_size=512, intermediate_size=3072, num_hidden_layers=2,
                            num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                            num_experts_per_tok=8, vocab_size=32000)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def run_once(checkpoint: Path, cache: Path) -> dict:
    env = dict(os.environ, ADAPT_CACHE=str(cache), TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1")
    done = subprocess.run([sys.executable, "-c", _RUN, str(checkpoint)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        checkpoint, cache = Path(work) / "ckpt", Path(work) / "cache"
        params = build(checkpoint)
        runs = [("cold", run_once(checkpoint, cache))] + [("warm", run_once(checkpoint, cache)) for _ in range(2)]
    load = os.getloadavg()[0]
    result = {"model": "Qwen3-MoE layout, 2 layers, width 1024, 64 experts top-8", "parameters": params,
              "cpu_count": os.cpu_count(), "load_average_1m": load, "runs": [{"cache": c, **r} for c, r in runs]}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ops-stage-cpu.json").write_text(json.dumps(result, indent=1))
    phases = sorted({k for _, r in runs for k in r["phases"]})
    lines = [
        "# Operators stage on this CPU, cold and warm",
        "",
        f"{result['model']} ({params / 1e6:.0f}M parameters, random init, bf16 on disk, loaded in fp32); "
        f"`run_ops` without ONNX export and patch check, each run in a fresh process; {result['cpu_count']} cores, "
        f"1-minute load average {load:.1f} at the end (other jobs shared the machine). Seconds:",
        "",
        "| cache | total | " + " | ".join(phases) + " |",
        "| --- | --- | " + " | ".join("---" for _ in phases) + " |",
    ]
    for cache_state, r in runs:
        cells = " | ".join(f"{r['phases'].get(k, 0.0):.2f}" for k in phases)
        lines.append(f"| {cache_state} | {r['seconds']:.2f} | {cells} |")
    (out / "ops-stage-cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
