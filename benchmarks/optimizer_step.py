"""One AdamW step over a reference model's parameters: torch's fused and foreach kernels against ``TritonAdamW``.

    PYTHONPATH=$PWD python benchmarks/optimizer_step.py --out DIR            # on the H200
    PYTHONPATH=$PWD python benchmarks/optimizer_step.py --out DIR --tiny     # rehearsal (CPU, Triton interpreter)

The parameters have the shapes of the model built from its config in ``benchmarks/shapes.py`` (read on the meta
device, so no weights are made), in bf16 as the end-to-end benchmark trains them.  Each optimizer steps
``--steps`` times on the same gradients after two warm-up steps, timed with CUDA events; GB/s counts the 14 bytes a
bf16 parameter's update must move (parameter, gradient and two moments read; parameter and moments written).
After the timing, each optimizer restarts from the same parameters and gradients for three steps, and the
parameters are compared with torch's fused result, so a faster kernel that computed something else shows.
Results: ``optimizer-step-<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.shapes import SHAPES

BYTES_PER_PARAM = 14  # bf16: read p, g, m, v; write p, m, v
HYPER = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def parameter_shapes(name: str, tiny: bool) -> list[tuple[int, ...]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = SHAPES[name]
    config = AutoConfig.for_model(shape["model_type"], **shape["tiny" if tiny else "full"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [tuple(p.shape) for p in model.parameters()]


def make_optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "adapt-triton":
        from operators.optim import TritonAdamW

        return TritonAdamW(params, **HYPER)
    return torch.optim.AdamW(params, fused=kind == "torch-fused", foreach=kind == "torch-foreach", **HYPER)


def fresh(shapes, device, seed: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) * 0.02) for s in shapes
    ]
    grads = [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) * 1e-3 for s in shapes]
    return params, grads


def time_kind(kind: str, shapes, device: str, steps: int) -> dict:
    params, grads = fresh(shapes, device, 0)
    for p, g in zip(params, grads):
        p.grad = g
    optimizer = make_optimizer(kind, params)
    for _ in range(2):
        optimizer.step()
    times, host = [], []
    for _ in range(steps):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
        t0 = time.perf_counter()
        optimizer.step()
        host.append(time.perf_counter() - t0)
        if device == "cuda":
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            times.append(time.perf_counter() - t0)
    del optimizer, params, grads
    times.sort()
    median = times[len(times) // 2]
    return {
        "step_ms_median": median * 1e3,
        "step_ms_min": times[0] * 1e3,
        "host_ms_median": sorted(host)[len(host) // 2] * 1e3,
    }


def three_steps(kind: str, shapes, device: str) -> list[torch.Tensor]:
    params, grads = fresh(shapes, device, 1)
    optimizer = make_optimizer(kind, params)
    for _ in range(3):
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
    return [p.detach() for p in params]


def agreement(kind: str, shapes, device: str) -> dict:
    """Largest difference from torch's fused result after three steps, in bf16 steps of the parameter."""
    ours, ref = three_steps(kind, shapes, device), three_steps("torch-fused", shapes, device)
    worst_abs, differing, total = 0.0, 0, 0
    for a, b in zip(ours, ref):
        diff = (a.float() - b.float()).abs()
        worst_abs = max(worst_abs, diff.max().item())
        differing += int((diff > 0).sum())
        total += diff.numel()
    return {"max_abs_diff_vs_fused": worst_abs, "share_differing_vs_fused": differing / total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="llama-1b,qwen3-moe,gemma2-2b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (rehearsal)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    kinds = ["torch-fused", "torch-foreach", "adapt-triton"]
    rows = []
    for name in args.models.split(","):
        shapes = parameter_shapes(name, args.tiny)
        numel = sum(torch.Size(s).numel() for s in shapes)
        for kind in kinds:
            row = {"model": name, "kind": kind, "tensors": len(shapes), "params": numel}
            try:
                row.update(time_kind(kind, shapes, device, args.steps))
                row["gb_per_s"] = numel * BYTES_PER_PARAM / (row["step_ms_median"] / 1e3) / 1e9
                if kind != "torch-fused":
                    row.update(agreement(kind, shapes, device))
            except Exception as err:  # noqa: BLE001 - one kind's failure is a finding, the others still run
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
            if device == "cuda":
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "h200" if device == "cuda" else "cpu"
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__, **HYPER}
    (out / f"optimizer-step-{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"optimizer-step-{tag}.md").write_text(render(meta, rows))
    return 0


HOST_BOUND = 0.8  # host time to issue a step, as a share of the step: past it the launches set the pace


def render(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# One AdamW step, bf16 parameters ({meta['device']}, torch {meta['torch']})",
        "",
        "Median of the timed steps, each timed alone (synchronised before it): a step whose host time nears its"
        " step time is paced by its launches, which a training loop overlaps with the backward pass. GB/s counts 14"
        " bytes per parameter. Difference: after three steps from the same state, against torch's fused kernel.",
        "",
        "| model | optimizer | tensors | params | step ms | GB/s | host ms | max diff vs fused | share differing | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['kind']} | {r['tensors']} | {r['params']:,} | {r['error']} | | | | | |")
            continue
        note = "host-bound" if r["host_ms_median"] >= HOST_BOUND * r["step_ms_median"] else ""
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['tensors']} | {r['params']:,} | {r['step_ms_median']:.2f} |"
            f" {r['gb_per_s']:,.0f} | {r['host_ms_median']:.2f} | {r.get('max_abs_diff_vs_fused', 0):.3g} |"
            f" {r.get('share_differing_vs_fused', 0):.3f} | {note} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
