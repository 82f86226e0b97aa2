"""Measure this machine for the planner's calibration: host cost per operator and the sustained GEMM rate.

One command on one GPU (a few minutes at most):

    python benchmarks/planner_dispatch.py --out benchmarks/results

writes ``planner-h200-calibration.json`` (the calibration format of ``parallel_planner.calibration``:
``dispatch`` from ``measure_dispatch_costs`` on the GPU, eager, DTensor and compiled; ``gemm_efficiency``
from back-to-back bf16 8192^3 matmuls) and a short markdown table.  ``benchmarks/planner_report.py``
folds the file into its "after calibration" column when it exists.  Each part runs in its own
subprocess and reports its own error; the whole stays under ``--budget-s``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}


def _dispatch() -> dict:
    import torch

    from parallel_planner.dispatch import measure_dispatch_costs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    costs = measure_dispatch_costs(device, compiled=True)
    return {"dispatch": {k: getattr(costs, k) for k in ("eager_s", "dtensor_s", "compiled_s")}, "source": costs.source}


def _gemm() -> dict:
    import torch

    n, repeats = 8192, 50
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):  # back to back: the sustained rate a long training step sees
        a @ b
    torch.cuda.synchronize()
    tflops = 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    return {"device": name, "gemm_tflops": tflops, "gemm_efficiency": min(1.0, tflops / peak) if peak else None}


PARTS = {"dispatch": _dispatch, "gemm": _gemm}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks/results"))
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument("--part", choices=tuple(PARTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        print(json.dumps(PARTS[args.part]()))
        return 0
    started, results = time.monotonic(), {}
    for part in PARTS:
        left = args.budget_s - (time.monotonic() - started)
        print(f"[planner_dispatch] {part} (budget left {left:.0f} s)", flush=True)
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--part", part],
                capture_output=True,
                text=True,
                check=False,
                timeout=max(left, 1),
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            results[part] = (
                json.loads(proc.stdout.strip().splitlines()[-1])
                if proc.returncode == 0
                else {"error": proc.stderr[-2000:]}
            )
        except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as err:
            results[part] = {"error": f"{type(err).__name__}: {err}"}
        print(f"[planner_dispatch] {part}: {results[part]}", flush=True)
    gemm, dispatch = results.get("gemm", {}), results.get("dispatch", {})
    calibration = {"device": gemm.get("device", "unknown"), "dtype": "bf16", "measured": results}
    if gemm.get("gemm_efficiency"):
        calibration["gemm_efficiency"] = gemm["gemm_efficiency"]
    if "dispatch" in dispatch:
        calibration["dispatch"] = dispatch["dispatch"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner-h200-calibration.json").write_text(json.dumps(calibration, indent=2))
    rows = [
        f"| {k} | {v} |"
        for k, v in {**calibration.get("dispatch", {}), "gemm_efficiency": calibration.get("gemm_efficiency")}.items()
    ]
    (out / "planner-h200-calibration.md").write_text(
        f"# Planner calibration measured on {calibration['device']}\n\n| quantity | value |\n| --- | --- |\n"
        + "\n".join(rows)
        + "\n"
    )
    return 0 if "dispatch" in calibration else 1


if __name__ == "__main__":
    raise SystemExit(main())
