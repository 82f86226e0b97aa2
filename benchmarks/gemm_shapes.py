"""bf16 GEMM and attention rates by shape on one GPU: the microbenchmark behind the planner's GEMM shape term.

    python benchmarks/gemm_shapes.py OUT.json            # also writes OUT.md, a short table
    python benchmarks/gemm_shapes.py --render OUT.json   # the table again from a saved JSON (no GPU)

Times ``(m x k) @ (k x n)`` through torch (cuBLAS) for: the 8192^3 reference the catalogue's ceiling is read
at, a sweep of the inner dimension ``k`` at a large output (16384 x 8192), and the forward, input-gradient and
weight-gradient GEMMs of the Megatron-Core GPT table's layers (hidden 2048..18432 at their TP degree, 4096 to
16384 tokens) and their vocabulary head; then causal SDPA (head dim 128, seq 4096) forward and forward +
backward under the cuDNN and flash backends.  Each figure is the mean of ``REPS`` back-to-back calls after
warm-up, between two CUDA events.  Needs a GPU; the planner reads the JSON, never runs this.
"""

import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root
from benchmarks.cuda_events import mean_seconds  # noqa: E402
from benchmarks.results_files import rerender_if_asked, write_results  # noqa: E402

REPS = 20
LAYERS = [(2048, 1), (4096, 2), (6144, 4), (7168, 8), (8192, 8), (10240, 8), (12288, 8), (16384, 8), (18432, 8)]


def rate(m: int, k: int, n: int) -> float:
    """TFLOP/s of ``(m x k) @ (k x n)`` in bf16 (weights stored ``n x k``, as nn.Linear keeps them)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return 2 * m * k * n / mean_seconds(lambda: a @ b.t(), REPS) / 1e12


def attention(backend: SDPBackend, backward: bool) -> float:
    """TFLOP/s of causal attention (batch 4, 16 heads of 128, seq 4096), causal FLOPs counted."""
    b, heads, s, d = 4, 16, 4096, 128
    q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flops = 4 * b * heads * s * s * d / 2 * (3.5 if backward else 1)

    def once() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            out.backward(torch.ones_like(out))

    with sdpa_kernel(backend):
        return flops / mean_seconds(once, REPS) / 1e12


def render(data: dict) -> str:
    """A short table: the K sweep, each layer width's GEMMs against the 8192^3 reference, and attention."""
    reference = statistics.median(data["reference_8192"] + data["reference_8192_after"])
    lines = [
        f"# bf16 GEMM rates by shape ({data['device']}, torch {data['torch']}, mean of {data['reps']} calls)",
        "",
        f"8192^3 reference: {', '.join(f'{r:.0f}' for r in data['reference_8192'])} TFLOP/s before the sweep, "
        f"{', '.join(f'{r:.0f}' for r in data['reference_8192_after'])} after (median {reference:.0f}; the spread "
        "is the clock under sustained load).",
        "",
        "| m x k x n | TFLOP/s | of the reference median |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {m} x {k} x {n} | {r:.0f} | {r / reference:.2f} |" for m, k, n, r in data["k_sweep"]]
    lines += [
        "",
        "| hidden | TP | tokens | fwd / dgrad / wgrad, mean of the layer's GEMMs (TFLOP/s) | of the reference |",
    ]
    lines += ["| --- | --- | --- | --- | --- |"]
    groups: dict[tuple[int, int, int], dict[str, list[float]]] = {}
    for kind, h, tp, *dims, r in data["layers"]:
        tokens = dims[0] if kind != "wgrad" else dims[1]
        groups.setdefault((h, tp, tokens), {}).setdefault(kind, []).append(r)
    for (h, tp, tokens), kinds in groups.items():
        means = [statistics.fmean(kinds[k]) for k in ("fwd", "dgrad", "wgrad")]
        rates = " / ".join(f"{m:.0f}" for m in means)
        lines.append(f"| {h} | {tp} | {tokens} | {rates} | {statistics.fmean(means) / reference:.2f} |")
    lines += ["", "Causal SDPA (batch 4, 16 heads of 128, seq 4096), causal FLOPs: "]
    lines[-1] += ", ".join(f"{k} {v:.0f}" for k, v in data["attention"].items()) + " TFLOP/s."
    return "\n".join(lines) + "\n"


def main(path: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": REPS}
    out["reference_8192"] = [rate(8192, 8192, 8192) for _ in range(3)]
    out["k_sweep"] = [[16384, k, 8192, rate(16384, k, 8192)] for k in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)]
    shapes = []
    for h, tp in LAYERS:
        for m in (4096, 8192, 16384):
            for k, n in ((h, 3 * h // tp), (h // tp, h), (h, 4 * h // tp), (4 * h // tp, h), (h, 131072 // tp)):
                shapes += [["fwd", h, tp, m, k, n, rate(m, k, n)], ["dgrad", h, tp, m, n, k, rate(m, n, k)]]
                shapes.append(["wgrad", h, tp, k, m, n, rate(k, m, n)])
    out["layers"] = shapes
    out["attention"] = {
        f"{name}_{'fwd_bwd' if bwd else 'fwd'}": attention(backend, bwd)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))
        for bwd in (False, True)
    }
    out["reference_8192_after"] = [rate(8192, 8192, 8192) for _ in range(3)]
    write_results(path, out, render)
    print(json.dumps({k: v for k, v in out.items() if k != "layers"}))


if __name__ == "__main__":
    if not rerender_if_asked(sys.argv[1:], render):
        main(sys.argv[1])
