"""Benchmark adapt's Triton kernels against HF eager, torch.compile and Liger-Kernel in one run.

Every case first checks adapt's kernel (forward and all gradients) against a float64 reference and
stops the run if it is wrong; then each variant is timed with ``triton.testing.do_bench`` (median),
forward alone (under ``no_grad``) and forward+backward, and its peak memory over the inputs during
forward+backward is read. A last phase replays forward+backward of the memory-bound kernels from a
CUDA graph: that is GPU time alone, without the Python/launch overhead that eager timing includes.
Bandwidth counts bytes read plus bytes written once each (``/work/shared/anchors.md``) and is
reported against a device-to-device copy measured in the same run.

    python benchmarks/kernel_speed.py --out benchmarks/results            # full run on a GPU
    TRITON_INTERPRET=1 python benchmarks/kernel_speed.py --smoke --out /tmp/k  # tiny shapes, CPU, logic only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import benchmarks.kernel_cases as cases  # noqa: E402

TOLERANCE = {torch.float32: 5e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


@dataclass
class Row:
    kernel: str
    shape: str
    variant: str
    fwd_ms: float | None = None
    fwd_gbps: float | None = None
    fwd_pct_copy: float | None = None
    fwd_pct_size_copy: float | None = None  # against a copy moving the same bytes (fixed launch/tail costs included)
    fwd_tflops: float | None = None
    fwdbwd_ms: float | None = None
    fwdbwd_gbps: float | None = None
    fwdbwd_tflops: float | None = None
    fwdbwd_graph_ms: float | None = None
    peak_mib: float | None = None
    error: str | None = None


@dataclass
class Results:
    device: str
    versions: dict
    copy_gbps: float
    rows: list[Row] = field(default_factory=list)
    checks: list[dict] = field(default_factory=list)
    sweeps: list[dict] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        (out / "kernels-h200.json").write_text(json.dumps(data, indent=1))
        (out / "kernels-h200.md").write_text(markdown(self))


def bench_ms(fn: Callable, grad_to_none=None, smoke: bool = False, quick: bool = False) -> float:
    if smoke:  # the interpreter: one timed call is enough to exercise the path
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    warmup, rep = (10, 40) if quick else (25, 100)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep = max(rep, 10 * start.elapsed_time(end))  # at least ~10 timed repetitions even for 50+ ms steps
    return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))


def copy_bandwidth(smoke: bool, numel: int | None = None) -> float:
    """Device-to-device bf16 copy, bytes read + written: 2 GiB by default, or ``numel`` elements."""
    numel = numel or ((1 << 20) if smoke else (1 << 30))
    src = torch.randn(numel, device=cases.DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), smoke=smoke)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def peak_mib(fn: Callable) -> float | None:
    if cases.DEVICE != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def graph_ms(step: Callable, leaves: list[torch.Tensor]) -> float:
    """Median replay time of ``step`` captured in a CUDA graph (GPU time without host overhead)."""
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in leaves:
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return float(do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))


def run_graph_phase(results: Results, only) -> None:
    """CUDA-graph forward+backward timings for the memory-bound kernels (run last: a failed capture can
    leave the CUDA context unusable, so it must not cost the eager measurements)."""
    rows = {(r.kernel, r.shape, r.variant): r for r in results.rows}
    for case in cases.all_cases(False, [k for k in cases.MEMORY_BOUND if only is None or k in only]):
        for variant, fn in case.variants.items():
            row = rows.get((case.kernel, case.shape, variant))
            if row is None or row.error:
                continue
            try:
                inputs = case.make()
                leaves = [t for t in inputs.values() if t.requires_grad]
                grads = [torch.randn_like(o) for o in _as_tuple(fn(**inputs))]
                row.fwdbwd_graph_ms = graph_ms(lambda: torch.autograd.backward(_as_tuple(fn(**inputs)), grads), leaves)
                print(f"graph {case.kernel} {case.shape} {variant}: {row.fwdbwd_graph_ms:.3f} ms", flush=True)
            except Exception as exc:
                row.error = f"graph capture: {type(exc).__name__}: {str(exc)[:120]}"
                print(row.error, flush=True)
            finally:
                inputs = leaves = grads = None
                torch.cuda.empty_cache()


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all():
        return math.inf
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def check(case: cases.Case) -> dict:
    """Forward and every input gradient of adapt's kernel against float64; raises when off."""
    inputs = case.make_check()
    leaves = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in inputs.items()}
    refs = {
        k: v.detach().double().requires_grad_(v.requires_grad) if v.is_floating_point() else v
        for k, v in inputs.items()
    }
    outs = _as_tuple(case.variants["adapt"](**leaves))
    ref_outs = _as_tuple(case.reference(**refs))
    errors = {}
    for i, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
        errors[f"out{i}"] = rel_err(o, r)
    grads = [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(ref_outs, [g.double() for g in grads])
    for name, leaf in leaves.items():
        if leaf.requires_grad:
            errors[f"d{name}"] = rel_err(leaf.grad, refs[name].grad)
    tol = TOLERANCE[case.dtype] * case.tolerance_scale
    failed = {k: v for k, v in errors.items() if not v <= (tol if k.startswith("out") else 2 * tol)}
    record = {"kernel": case.kernel, "shape": case.shape, "errors": errors, "tolerance": tol, "ok": not failed}
    if failed:
        raise RuntimeError(f"{case.kernel} {case.shape}: adapt kernel disagrees with float64: {failed}")
    return record


def run_case(case: cases.Case, results: Results, smoke: bool, skip: set[str]) -> None:
    results.checks.append(check(case))
    print(f"checked {case.kernel} {case.shape}: {results.checks[-1]['errors']}", flush=True)
    size_copy_gbps = copy_bandwidth(smoke, case.fwd_bytes // 4) if case.kernel in cases.MEMORY_BOUND else None
    for variant, fn in case.variants.items():
        if variant in skip:
            continue
        row = Row(case.kernel, case.shape, variant)
        try:
            inputs = case.make()
            leaves = [t for t in inputs.values() if t.requires_grad]
            with torch.no_grad():
                row.fwd_ms = bench_ms(lambda: fn(**inputs), smoke=smoke)
            outs = _as_tuple(fn(**inputs))
            grads = [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in outs]
            del outs

            def step():
                torch.autograd.backward(_as_tuple(fn(**inputs)), grads)

            if case.backward:
                row.fwdbwd_ms = bench_ms(step, grad_to_none=leaves, smoke=smoke)
                for t in leaves:
                    t.grad = None
                row.peak_mib = peak_mib(step)
            else:
                with torch.no_grad():
                    row.peak_mib = peak_mib(lambda: fn(**inputs))
        except Exception as exc:  # a reference variant failing is recorded, not fatal
            row.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            inputs = leaves = grads = None
            if cases.DEVICE == "cuda":
                torch.cuda.empty_cache()
        if row.fwd_ms:
            row.fwd_gbps = case.fwd_bytes / row.fwd_ms / 1e6 if case.fwd_bytes else None
            row.fwd_pct_copy = 100 * row.fwd_gbps / results.copy_gbps if row.fwd_gbps else None
            if row.fwd_gbps and size_copy_gbps:
                row.fwd_pct_size_copy = 100 * row.fwd_gbps / size_copy_gbps
            row.fwd_tflops = case.fwd_flops / row.fwd_ms / 1e9 if case.fwd_flops else None
        if row.fwdbwd_ms:
            row.fwdbwd_gbps = case.fwdbwd_bytes / row.fwdbwd_ms / 1e6 if case.fwdbwd_bytes else None
            row.fwdbwd_tflops = case.fwdbwd_flops / row.fwdbwd_ms / 1e9 if case.fwdbwd_flops else None
        results.rows.append(row)
        print(
            f"  {variant:>16}: fwd {_fmt(row.fwd_ms, 3)} ms ({_fmt(row.fwd_pct_copy, 1)}% copy) "
            f"fwd+bwd {_fmt(row.fwdbwd_ms, 3)} ms peak {_fmt(row.peak_mib, 0)} MiB {row.error or ''}",
            flush=True,
        )


def _fmt(v, digits):
    return "-" if v is None else f"{v:,.{digits}f}"


def evaluate_targets(results: Results) -> None:
    """Each target of the issue, read off this run's rows (measured, never assumed)."""
    by = {}
    for r in results.rows:
        by[(r.kernel, r.shape, r.variant)] = r

    def get(kernel, shape, variant, attr):
        r = by.get((kernel, shape, variant))
        return getattr(r, attr) if r is not None else None

    shapes = sorted({(r.kernel, r.shape) for r in results.rows})
    for kernel, shape in shapes:
        ours_f, ours_fb = get(kernel, shape, "adapt", "fwd_ms"), get(kernel, shape, "adapt", "fwdbwd_ms")
        liger_f, liger_fb = get(kernel, shape, "liger", "fwd_ms"), get(kernel, shape, "liger", "fwdbwd_ms")
        compile_fb, eager_fb = (
            get(kernel, shape, "torch.compile", "fwdbwd_ms"),
            get(kernel, shape, "hf_eager", "fwdbwd_ms"),
        )
        pct = get(kernel, shape, "adapt", "fwd_pct_copy")

        def add(name, measured, goal, ok):
            results.targets.append(
                {
                    "kernel": kernel,
                    "shape": shape,
                    "target": name,
                    "measured": measured,
                    "goal": goal,
                    "met": bool(ok) if ok is not None else None,
                }
            )

        if kernel == "rms_norm" and pct is not None:
            add("fwd >= 95% of copy", round(pct, 1), 95, pct >= 95)
            refs = [v for v in (liger_fb, compile_fb) if v]
            if refs and ours_fb:
                add(
                    "fwd+bwd <= 0.9x min(liger, compile)",
                    round(ours_fb / min(refs), 3),
                    0.9,
                    ours_fb <= 0.9 * min(refs),
                )
        if kernel == "swiglu" and pct is not None:
            add("fwd >= 97% of copy", round(pct, 1), 97, pct >= 97)
        if kernel in ("add_rms_norm", "layer_norm", "geglu", "rope", "swiglu") and liger_fb and ours_fb:
            add("fwd+bwd time <= liger", round(ours_fb / liger_fb, 3), 1.0, ours_fb <= liger_fb)
            if liger_f and ours_f:
                add("fwd time <= liger", round(ours_f / liger_f, 3), 1.0, ours_f <= liger_f)
        if kernel == "fused_linear_ce" and liger_fb and ours_fb:
            add("fwd+bwd time <= liger", round(ours_fb / liger_fb, 3), 1.0, ours_fb <= liger_fb)
            ours_mem, liger_mem = get(kernel, shape, "adapt", "peak_mib"), get(kernel, shape, "liger", "peak_mib")
            if ours_mem and liger_mem:
                add("peak memory <= liger", round(ours_mem / liger_mem, 3), 1.0, ours_mem <= liger_mem * 1.001)
        if kernel in cases.MEMORY_BOUND and eager_fb and ours_fb:
            add("fwd+bwd >= 2.6x faster than HF eager", round(eager_fb / ours_fb, 2), 2.6, eager_fb / ours_fb >= 2.6)
        if kernel == "grouped_gemm" and ours_fb:
            loop_fb = get(kernel, shape, "torch.mm loop", "fwdbwd_ms")
            if loop_fb:
                add(
                    "fwd+bwd vs per-expert torch.mm loop (speed-up)",
                    round(loop_fb / ours_fb, 2),
                    1.0,
                    ours_fb <= loop_fb,
                )


def markdown(results: Results) -> str:
    lines = [
        f"# adapt kernels on {results.device}",
        "",
        f"Versions: {results.versions}. Copy bandwidth measured in this run: **{results.copy_gbps:,.0f} GB/s** "
        "(bytes read + written). Times are `do_bench` medians; GB/s counts bytes read plus written once.",
        "",
        '"% copy" is against that 2 GiB copy (the issue\'s yardstick); "% same-size copy" is against a copy '
        "moving the same bytes as the kernel's forward, which pays the same launch, ramp and tail costs.",
        "",
        "| kernel | shape | variant | fwd ms | fwd GB/s | % copy | % same-size copy | fwd TFLOP/s | fwd+bwd ms "
        "| fwd+bwd TFLOP/s | fwd+bwd ms, CUDA graph | peak MiB | note |",
        "| --- " * 13 + "|",
    ]
    for r in results.rows:
        lines.append(
            f"| {r.kernel} | {r.shape} | {r.variant} | {_fmt(r.fwd_ms, 3)} | {_fmt(r.fwd_gbps, 0)} | "
            f"{_fmt(r.fwd_pct_copy, 1)} | {_fmt(r.fwd_pct_size_copy, 1)} | {_fmt(r.fwd_tflops, 0)} | {_fmt(r.fwdbwd_ms, 3)} | "
            f"{_fmt(r.fwdbwd_tflops, 0)} | {_fmt(r.fwdbwd_graph_ms, 3)} | {_fmt(r.peak_mib, 0)} | "
            f"{r.error or ''} |"
        )
    lines += ["", "## Targets", "", "| kernel | shape | target | measured | goal | met |", "| --- " * 6 + "|"]
    for t in results.targets:
        lines.append(
            f"| {t['kernel']} | {t['shape']} | {t['target']} | {t['measured']} | {t['goal']} | "
            f"{'yes' if t['met'] else 'NO'} |"
        )
    if results.sweeps:
        lines += [
            "",
            "## Launch-config sweeps (adapt kernels alone, best 5 per kernel and shape)",
            "",
            "| kernel | shape | config | ms |",
            "| --- " * 4 + "|",
        ]
        groups: dict = {}
        for s in results.sweeps:
            groups.setdefault((s["kernel"], s["shape"]), []).append(s)
        for group in groups.values():
            for s in sorted(group, key=lambda s: s["ms"])[:5]:
                lines.append(f"| {s['kernel']} | {s['shape']} | {s['config']} | {s['ms']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (for the CPU interpreter)")
    parser.add_argument("--only", nargs="*", default=None, help="kernels to run (default: all)")
    parser.add_argument("--skip-variants", nargs="*", default=[], help="e.g. torch.compile")
    parser.add_argument("--sweep", action="store_true", help="also sweep adapt's launch configs")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph forward+backward phase")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if cases.DEVICE == "cuda" else "cpu (Triton interpreter)"
    versions = {
        "torch": torch.__version__,
        "triton": cases.triton_version(),
        "transformers": cases.hf_version(),
        "liger_kernel": cases.liger_version(),
    }
    results = Results(device=device, versions=versions, copy_gbps=copy_bandwidth(args.smoke))
    print(f"{device} {versions} copy {results.copy_gbps:,.0f} GB/s", flush=True)
    if args.sweep:
        quick_bench = lambda fn, **kw: bench_ms(fn, smoke=args.smoke, quick=True, **kw)  # noqa: E731
        results.sweeps = cases.sweep_configs(quick_bench, args.smoke)
        results.save(args.out)
    for case in cases.all_cases(args.smoke, args.only):
        run_case(case, results, args.smoke, set(args.skip_variants))
        results.targets = []
        evaluate_targets(results)
        results.save(args.out)
    if cases.DEVICE == "cuda" and not args.no_graphs:
        run_graph_phase(results, args.only)
        results.save(args.out)
    for t in results.targets:
        print(
            f"{'MET ' if t['met'] else 'MISS'} {t['kernel']:>16} {t['shape']:>22} {t['target']}: "
            f"{t['measured']} (goal {t['goal']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
