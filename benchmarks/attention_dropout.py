"""What dropout costs on a GH100-class GPU: inside flash attention, and in the residual branch.

    PYTHONPATH=$PWD python benchmarks/attention_dropout.py --out benchmarks/results     # on the H200

The planner's time model needs two rates it had taken as free (issue 15, Megatron-Core's rows run with
Megatron's default dropout 0.1 on attention and on each residual branch):

- causal attention forward and forward + backward, with ``dropout_p`` 0 and 0.1, under each SDPA backend that
  runs it (cuDNN, flash, memory-efficient), at Megatron-Core's attention shapes (head dim 128, seq 4096);
- Megatron's fused bias-dropout-add (``residual + dropout(x + bias)``), compiled, against the same add without
  dropout, forward + backward, as seconds per element: the bytes the mask adds.

Each figure is the mean of ``REPS`` back-to-back calls after three warm-up calls, timed with CUDA events.  Results:
``attention-dropout-h200.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root
from benchmarks.cuda_events import mean_seconds  # noqa: E402
from benchmarks.results_files import write_results  # noqa: E402

REPS = 20
DROPOUT = 0.1
SHAPES = ((4, 16, 4096, 128), (2, 16, 4096, 128), (4, 12, 4096, 128), (1, 16, 4096, 128))  # batch, heads, seq, dim
BACKENDS = (
    ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ("flash", SDPBackend.FLASH_ATTENTION),
    ("efficient", SDPBackend.EFFICIENT_ATTENTION),
)


def attention_rate(backend: SDPBackend, shape: tuple, dropout: float, backward: bool) -> float | None:
    """TFLOP/s of causal attention (causal FLOPs counted, backward 2.5x the forward), or None if no kernel runs."""
    b, heads, s, d = shape
    q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16)
    flops = 4 * b * heads * s * s * d / 2 * (3.5 if backward else 1)

    def once() -> None:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        if backward:
            out.backward(grad)

    try:
        with sdpa_kernel(backend):
            seconds = mean_seconds(once, REPS)
    except RuntimeError as exc:  # the backend has no kernel for this case (e.g. dropout)
        print(f"{backend.name} dropout={dropout} backward={backward}: {str(exc).splitlines()[0][:160]}", flush=True)
        return None
    return flops / seconds / 1e12


def _bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, p: float) -> torch.Tensor:
    return residual + F.dropout(x + bias, p=p, training=True)


def residual_dropout(tokens: int, hidden: int) -> dict:
    """Nanoseconds per element of the compiled bias-dropout-add, forward + backward, with and without dropout."""
    compiled = torch.compile(_bias_dropout_add)
    result = {}
    for p in (0.0, DROPOUT):
        x, residual = (
            torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)
        )
        bias = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)

        def once(p=p, x=x, bias=bias, residual=residual, grad=grad) -> None:
            compiled(x, bias, residual, p).backward(grad)

        result[f"p{p}"] = mean_seconds(once, REPS) / (tokens * hidden) * 1e9
    return result


def render(data: dict) -> str:
    lines = [
        f"# Dropout's cost on the GPU ({data['device']}, torch {data['torch']}, mean of {REPS} calls)",
        "",
        "Causal attention, bf16, TFLOP/s counting causal FLOPs (forward + backward: 3.5x the forward's). "
        f"`p={DROPOUT}` / `p=0` is the rate with dropout over the rate without it; `-`: the backend has no kernel.",
        "",
        "| batch x heads x seq x dim | backend | fwd p=0 | fwd p=0.1 | ratio | fwd+bwd p=0 | fwd+bwd p=0.1 | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def cell(value):
        return "-" if value is None else f"{value:.0f}"

    def ratio(a, b):
        return "-" if a is None or b is None else f"{b / a:.2f}"

    for row in data["attention"]:
        lines.append(
            f"| {' x '.join(map(str, row['shape']))} | {row['backend']} | {cell(row['fwd_p0'])} | {cell(row['fwd_p'])} "
            f"| {ratio(row['fwd_p0'], row['fwd_p'])} | {cell(row['fwd_bwd_p0'])} | {cell(row['fwd_bwd_p'])} "
            f"| {ratio(row['fwd_bwd_p0'], row['fwd_bwd_p'])} |"
        )
    lines += [
        "",
        "Bias-dropout-add (`residual + dropout(x + bias)`, compiled), forward + backward, ns per element:",
        "",
        "| tokens x hidden | p=0 | p=0.1 | added |",
        "| --- | --- | --- | --- |",
    ]
    for row in data["residual"]:
        lines.append(
            f"| {row['tokens']} x {row['hidden']} | {row['p0.0']:.4f} | {row[f'p{DROPOUT}']:.4f} "
            f"| {row[f'p{DROPOUT}'] - row['p0.0']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dropout": DROPOUT, "attention": []}
    for shape in SHAPES:
        for name, backend in BACKENDS:
            row = {"shape": list(shape), "backend": name}
            for key, p, bwd in (
                ("fwd_p0", 0.0, False),
                ("fwd_p", DROPOUT, False),
                ("fwd_bwd_p0", 0.0, True),
                ("fwd_bwd_p", DROPOUT, True),
            ):
                row[key] = attention_rate(backend, shape, p, bwd)
            data["attention"].append(row)
            print(row, flush=True)
    data["residual"] = [
        {"tokens": tokens, "hidden": hidden, **residual_dropout(tokens, hidden)}
        for tokens, hidden in ((16384, 2048), (16384, 4096), (8192, 8192))
    ]
    print(write_results(out / "attention-dropout-h200.json", data, render))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    main(parser.parse_args().out)
