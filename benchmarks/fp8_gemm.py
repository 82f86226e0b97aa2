"""fp8 training's two costs on a GH100-class GPU: the scaled GEMMs by recipe, and the quantisation passes.

    PYTHONPATH=$PWD python benchmarks/fp8_gemm.py --out benchmarks/results     # on the H200

The planner had costed an fp8 recipe's GEMMs at the fp8 peak times the bf16 ceiling, and its quantisation as free
(issue 15: DeepSeek-V3's row, fine-grained fp8).  This measures, at DeepSeek-V3's expert and attention shapes and at
8192^3:

- bf16 ``mm`` against fp8 ``scaled_mm`` under each scaling recipe torch runs on this GPU: one scale per tensor
  (Transformer Engine's delayed scaling), per row, and DeepSeek-V3's blocks (1x128 activation tiles against
  128x128 weight blocks); a recipe torch has no kernel for is recorded with its error;
- the quantisation passes such a recipe adds around each GEMM, compiled with Inductor: a bf16 activation cast to
  fp8 with one scale per 1x128 tile, and the same cast of its transpose (the weight-gradient GEMM reads it
  column-wise), as GB/s counting bytes read and written once each, beside a plain device copy.

Each figure is the mean of ``REPS`` back-to-back calls after three warm-up calls, timed with CUDA events.
Results: ``fp8-gemm-h200.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root
from benchmarks.cuda_events import mean_seconds  # noqa: E402
from benchmarks.results_files import write_results  # noqa: E402

REPS = 20
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# (m, k, n): the reference cube; DeepSeek-V3's routed expert (tokens x hidden 7168 -> 2 x 2048, 2048 -> 7168) at 8192
# tokens an expert, forward, input-gradient and weight-gradient orientation; its attention output projection.
SHAPES = (
    (8192, 8192, 8192),
    (8192, 7168, 4096),
    (8192, 4096, 7168),
    (7168, 8192, 4096),
    (8192, 2048, 7168),
    (8192, 7168, 2048),
    (2048, 8192, 7168),
    (4096, 16384, 7168),
)


def _operands(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A row-major ``(m, k)`` activation and a ``(k, n)`` weight stored ``(n, k)`` (column-major), as nn.Linear."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return a, w.t()


def _scales(recipe: str, m: int, k: int, n: int) -> tuple:
    """(scale_a, recipe_a, scale_b, recipe_b) for ``recipe``, laid out as torch's SM90 kernels take them."""
    kind = F.ScalingType
    one = torch.ones((), device="cuda", dtype=torch.float32)
    if recipe == "tensorwise":
        return one, kind.TensorWise, one, kind.TensorWise
    if recipe == "rowwise":
        a = torch.ones(m, 1, device="cuda", dtype=torch.float32)
        b = torch.ones(1, n, device="cuda", dtype=torch.float32)
        return a, kind.RowWise, b, kind.RowWise
    # blockwise: 1x128 tiles of the activation (outer-dim-major scales), 128x128 blocks of the weight
    a = torch.ones(k // 128, m, device="cuda", dtype=torch.float32).t()
    b = torch.ones(n // 128, k // 128, device="cuda", dtype=torch.float32).t()
    return a, kind.BlockWise1x128, b, kind.BlockWise128x128


def gemm_rates(m: int, k: int, n: int) -> dict:
    """TFLOP/s of bf16 ``mm`` and of fp8 ``scaled_mm`` per recipe (an error string where torch has no kernel)."""
    a, b = _operands(m, k, n)
    flops = 2 * m * k * n
    out: dict = {"shape": [m, k, n], "bf16": flops / mean_seconds(lambda: torch.mm(a, b)) / 1e12}
    a8, b8 = a.to(FP8), b.t().contiguous().to(FP8).t()
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        try:
            sa, ra, sb, rb = _scales(recipe, m, k, n)
            out[recipe] = (
                flops / mean_seconds(lambda sa=sa, ra=ra, sb=sb, rb=rb: F.scaled_mm(a8, b8, sa, ra, sb, rb)) / 1e12
            )
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            out[recipe] = str(exc).splitlines()[0][:200]
    return out


def _quantise_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 with one scale per 1x128 tile of each row (DeepSeek-V3 sec. 3.3.2)."""
    rows, cols = x.shape
    tiles = x.float().reshape(rows, cols // 128, 128)
    scale = tiles.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (tiles / scale).to(FP8).reshape(rows, cols), scale.squeeze(-1)


def _quantise_transposed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same cast of ``x`` transposed: what a weight-gradient GEMM reads column-wise."""
    return _quantise_tiles(x.t())


def quantisation_rates(tokens: int, width: int) -> dict:
    """GB/s (bytes read + written) of the compiled casts, and of a device-to-device copy of the bf16 input."""
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    moved = tokens * width * (2 + 1) + tokens * width // 128 * 4
    result = {"tokens": tokens, "width": width}
    for name, fn in (("tiles", _quantise_tiles), ("transposed", _quantise_transposed)):
        compiled = torch.compile(fn)
        result[name] = moved / mean_seconds(lambda compiled=compiled: compiled(x)) / 1e9
    y = torch.empty_like(x)
    result["copy"] = 2 * x.numel() * 2 / mean_seconds(lambda: y.copy_(x)) / 1e9
    return result


def render(data: dict) -> str:
    def cell(value) -> str:
        return f"{value:.0f}" if isinstance(value, float) else "-"

    lines = [
        f"# fp8 GEMMs and quantisation ({data['device']}, torch {data['torch']}, mean of {REPS} calls)",
        "",
        "TFLOP/s (dense peaks: bf16 989, fp8 1979). `-`: torch has no kernel for that recipe here (the JSON holds "
        "the error). blockwise: 1x128 activation tiles x 128x128 weight blocks, DeepSeek-V3's recipe.",
        "",
        "| m x k x n | bf16 | fp8 tensorwise | fp8 rowwise | fp8 blockwise | blockwise / fp8 peak |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in data["gemms"]:
        block = row["blockwise"]
        share = f"{block / 1979:.2f}" if isinstance(block, float) else "-"
        lines.append(
            f"| {' x '.join(map(str, row['shape']))} | {cell(row['bf16'])} | {cell(row['tensorwise'])} "
            f"| {cell(row['rowwise'])} | {cell(block)} | {share} |"
        )
    lines += [
        "",
        "Quantisation to fp8 with 1x128 tile scales, compiled (GB/s, bytes read + written once each; copy: the bf16 "
        "input copied on the device):",
        "",
        "| tokens x width | tiles | transposed | copy |",
        "| --- | --- | --- | --- |",
    ]
    for row in data["quantisation"]:
        lines.append(
            f"| {row['tokens']} x {row['width']} | {row['tiles']:.0f} | {row['transposed']:.0f} | {row['copy']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gemms": [], "quantisation": []}
    for shape in SHAPES:
        data["gemms"].append(gemm_rates(*shape))
        print(data["gemms"][-1], flush=True)
    for tokens, width in ((8192, 7168), (8192, 2048), (16384, 4096)):
        data["quantisation"].append(quantisation_rates(tokens, width))
        print(data["quantisation"][-1], flush=True)
    print(write_results(out / "fp8-gemm-h200.json", data, render))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    main(parser.parse_args().out)
