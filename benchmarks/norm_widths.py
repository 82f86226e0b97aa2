"""RMSNorm forward + backward at the widths the zoo's architectures use, with bf16 and fp32 weights.

    PYTHONPATH=$PWD python benchmarks/norm_widths.py --out benchmarks/results     # on the H200

Why: on the H200 the operators stage timed adapt's Triton RMSNorm at 0.68 and 1.61 ms against Inductor's 0.28 ms on
gpt-oss (width 2880, whose norms transformers keeps in fp32 under bf16 activations), while at Llama's and Gemma-2's
widths (2048, 2304; bf16 weights) it was the fastest.  This separates the two differences (a width that is not a
power of two, and an fp32 weight beside bf16 rows) and times every candidate the plan chooses among in one run.

Each case: rows of bf16 activations (batch 4 x 2048 tokens), ``y = (w * normalise(x).float()).to(bf16)`` (the casting
order gpt-oss and Gemma share), forward + backward with both gradients.  Every candidate is first checked against a
float64 reference (forward and both gradients); a candidate that fails is reported and not timed.  Times are the mean
of back-to-back calls between CUDA events.  Results: ``norm-widths-h200.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root
from benchmarks.cuda_events import mean_seconds  # noqa: E402
from benchmarks.results_files import rerender_if_asked, write_results  # noqa: E402
from benchmarks.step_profile import profile_steps  # noqa: E402
from operators.benchmark import DeviceTimer, time_ms  # noqa: E402
from operators.kernels import rms_norm  # noqa: E402

ROWS = (8192, 32768)  # batch 4 x 2048 tokens, and four times that (where launch costs no longer hide the kernels)
CASES = ((2048, "bfloat16"), (2304, "bfloat16"), (2880, "bfloat16"), (2880, "float32"), (4096, "bfloat16"))
EPS = 1e-6
REPS = 50
TOLERANCE = 2e-2  # bf16 output and gradients against float64: relative to each tensor's largest magnitude


def hf_style(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The module as transformers writes it for gpt-oss: normalise in fp32, scale by the weight, round once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (weight * h).to(x.dtype)


def candidates() -> dict[str, Callable]:
    found = {
        "adapt-triton": lambda x, w: rms_norm(x, w, EPS, 0.0, "scale_then_round"),
        "eager (HF module)": hf_style,
        "inductor": torch.compile(hf_style, dynamic=False),
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        print("liger-kernel not installed: its column stays empty", flush=True)
    else:
        found["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma", False)
    return found


def _worst_error(fn: Callable, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> float:
    """Largest error of output, dx and dw against float64, each relative to the reference's largest magnitude."""
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = wr * (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + EPS))
    ref.backward(dy.double())
    xc, wc = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(xc, wc)
    out.backward(dy)
    pairs = ((out, ref), (xc.grad, xr.grad), (wc.grad, wr.grad))
    return max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in pairs)


def measure_case(name: str, fn: Callable, rows: int, width: int, weight_dtype: str) -> dict:
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(width, device="cuda", dtype=torch.float32)).to(getattr(torch, weight_dtype))
    w.requires_grad_()
    dy = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    row = {"candidate": name, "rows": rows, "width": width, "weight_dtype": weight_dtype}
    try:
        row["error"] = _worst_error(fn, x, w, dy)
    except Exception as exc:  # a candidate that cannot run this case is reported, not timed
        row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return row
    if row["error"] > TOLERANCE:
        row["failed"] = f"wrong: error {row['error']:.3g} over {TOLERANCE}"
        return row

    def forward() -> None:
        with torch.no_grad():
            fn(x, w)

    def forward_backward() -> None:
        x.grad = w.grad = None
        fn(x, w).backward(dy)

    row["fwd_ms"] = mean_seconds(forward, REPS) * 1e3
    row["fwd_bwd_ms"] = mean_seconds(forward_backward, REPS) * 1e3
    row["ops_stage_ms"] = time_ms(lambda: fn(x, w).float().sum().backward(), DeviceTimer())
    profile = profile_steps(lambda _: forward_backward(), "cuda", steps=10)
    row["fwd_bwd_device_ms"] = profile["device_busy_ms_per_step"]
    row["kernels"] = {name[:60]: round(ms, 4) for name, ms in profile["by_name_ms_per_step"].items()}
    return row


def render(data: dict) -> str:
    lines = [
        f"# RMSNorm by width and weight dtype ({data['device']}, torch {data['torch']}, mean of {REPS} calls)",
        "",
        "Rows of bf16 activations; the weight's dtype as stated; ms: forward (no grad) / forward + backward with both "
        "gradients, each the host's pace of back-to-back calls / the device's busy time in forward + backward "
        "(profiler, 10 calls: the kernels alone, without launch gaps). Copy floor = one read and one write of the rows "
        f"(forward) at the measured copy rate ({data['copy_gbps']:.0f} GB/s); forward + backward moves about 2.5 times "
        "that. The last figure is the operators stage's own timing (``operators.benchmark``: device time after a "
        "GPU sleep, forward + ``out.float().sum()`` backward, median). `x` = failed its float64 check or could not run (see the JSON).",
        "",
    ]
    names = list(dict.fromkeys(row["candidate"] for row in data["rows"]))
    lines += [
        "| rows x width | weight | copy floor fwd | " + " | ".join(names) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    by_key = {(r["candidate"], r["rows"], r["width"], r["weight_dtype"]): r for r in data["rows"]}
    for rows, width, dtype in dict.fromkeys((r["rows"], r["width"], r["weight_dtype"]) for r in data["rows"]):
        cells = []
        for name in names:
            row = by_key[(name, rows, width, dtype)]
            timed = (row.get(k) for k in ("fwd_ms", "fwd_bwd_ms", "fwd_bwd_device_ms", "ops_stage_ms"))
            cells.append("x" if "failed" in row else " / ".join(f"{t:.3f}" for t in timed))
        floor = 2 * rows * width * 2 / (data["copy_gbps"] * 1e9) * 1e3
        lines.append(f"| {rows} x {width} | {dtype} | {floor:.3f} | " + " | ".join(cells) + " |")
    lines += ["", *(f"- {note}" for note in data.get("notes", []))] if data.get("notes") else []
    return "\n".join(lines) + "\n"


def copy_gbps() -> float:
    src = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * src.numel() / mean_seconds(lambda: dst.copy_(src), 20) / 1e9


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbps": copy_gbps(), "rows": []}
    for rows in ROWS:
        for width, dtype in CASES:
            torch._dynamo.reset()  # a fresh compile per case: Dynamo's recompile limit would otherwise run eager
            for name, fn in candidates().items():
                row = measure_case(name, fn, rows, width, dtype)
                data["rows"].append(row)
                print({k: v for k, v in row.items() if k != "kernels"}, flush=True)
    print(write_results(out / "norm-widths-h200.json", data, render))


if __name__ == "__main__":
    if not rerender_if_asked(sys.argv[1:], render):
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--out", type=Path, required=True)
        main(parser.parse_args().out)
