"""How long the host takes to issue each phase of one training step, against how long the device runs it.

    PYTHONPATH=$PWD python benchmarks/host_profile.py --out DIR [--model llama-1b] [--variants adapt,compile]

Variants: ``adapt`` (the plan's kernels and compilation, adapt's AdamW), ``adapt-inductor-ops`` (that, with the
kernels registered as ``triton_op``: ``ADAPT_KERNEL_OPS=inductor`` in its process, as in ``benchmarks/e2e.py``) and
``compile`` (the whole model compiled, torch's fused AdamW).

A phase whose issue time exceeds its device time leaves the device idle however fast its kernels are: that is
the part of a step that host overhead, not kernel time, limits.  Each variant runs in its own process.  Per phase
(forward with the loss, backward, optimizer step): the device time from CUDA events, and the host's issue time
with the device held busy beforehand (``torch.cuda._sleep``), so that the host never waits on it; a measurement
whose sleep ran out before the host finished issuing is flagged (the launch queue filled, or the sleep was too
short).  Then Python's profiler over the forward's issue, summed by package.  Writes ``host-profile-<model>.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.e2e_worker import VARIANT_ENV
from benchmarks.shapes import SHAPES, build_checkpoint, load_checkpoint

PHASES = ("forward", "backward", "optimizer")
VARIANTS = ("adapt", "adapt-inductor-ops", "compile")
SLEEP_MS = 400.0


def _package(filename: str) -> str:
    """The package a profiled function belongs to, as the summary groups them."""
    for marker, name in (
        ("/operators/", "adapt operators"),
        ("/adapt/", "adapt"),
        ("torch/_dynamo", "torch dynamo (guards, frames)"),
        ("torch/_inductor", "torch inductor (compiled graphs, launchers)"),
        ("torch/_functorch", "torch aot autograd (runtime wrappers)"),
        ("torch/_library", "torch.library (custom ops)"),
        ("torch/autograd", "torch autograd"),
        ("site-packages/torch", "torch other"),
        ("triton", "triton (launch)"),
        ("transformers", "transformers"),
        ("liger_kernel", "liger"),
    ):
        if marker in filename:
            return name
    return "builtins and C" if filename.startswith("~") or filename == "" else "other"


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_checkpoint(args.model, Path(tmp) / "checkpoint")
        plan = None
        if args.variant != "compile":
            from operators import run_ops

            plan = run_ops(str(checkpoint), onnx=False, check_patch=False).plan
        model = load_checkpoint(checkpoint).cuda().train()
    if plan is not None:
        from operators import adapt_model
        from operators.optim import TritonAdamW

        adapt_model(model, plan)
        optimizer: Any = TritonAdamW(model.parameters(), lr=1e-5)
    else:
        model.compile()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")
    state: dict[str, Any] = {}

    def forward() -> None:
        state["loss"] = model(input_ids=ids, labels=ids).loss

    def backward() -> None:
        state["loss"].backward()

    def step_optimizer() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    phases = dict(zip(PHASES, (forward, backward, step_optimizer)))
    for _ in range(args.warmup):
        for fn in phases.values():
            fn()
    torch.cuda.synchronize()
    cycles_per_ms = _sleep_rate(torch)
    device_ms: dict[str, list[float]] = {p: [] for p in PHASES}
    host_ms: dict[str, list[float]] = {p: [] for p in PHASES}
    uncovered: dict[str, int] = {p: 0 for p in PHASES}
    for _ in range(args.steps):
        for name, fn in phases.items():  # device time: nothing held back
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            device_ms[name].append(begin.elapsed_time(end))
        for name, fn in phases.items():  # issue time: the device asleep until the host has issued everything
            if name == "backward":
                torch.cuda.synchronize()
                forward()
            elif name == "optimizer":
                torch.cuda.synchronize()
                forward()
                backward()
            torch.cuda.synchronize()
            torch.cuda._sleep(int(SLEEP_MS * cycles_per_ms))
            asleep = torch.cuda.Event()
            asleep.record()
            t0 = time.perf_counter()
            fn()
            host_ms[name].append((time.perf_counter() - t0) * 1e3)
            uncovered[name] += int(asleep.query())  # the sleep had ended: the host waited somewhere
            torch.cuda.synchronize()
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(SLEEP_MS * cycles_per_ms))
    profile.enable()
    forward()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    by_package: dict[str, float] = {}
    rows = []
    for (filename, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        package = _package(filename)
        by_package[package] = by_package.get(package, 0.0) + tottime * 1e3
        rows.append({"function": f"{filename.split('site-packages/')[-1]}:{line} {func}", "calls": calls,
                     "self_ms": round(tottime * 1e3, 3), "cumulative_ms": round(cumtime * 1e3, 3)})  # fmt: skip
    rows.sort(key=lambda r: -r["self_ms"])
    median = {p: round(statistics.median(v), 3) for p, v in device_ms.items()}
    issue = {p: round(statistics.median(v), 3) for p, v in host_ms.items()}
    from operators.kernels._registration import MODE

    return {
        "variant": args.variant,
        "kernel_ops": MODE if args.variant != "compile" else None,  # how this process registered adapt's kernels
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "device_ms": median,
        "host_issue_ms": issue,
        "host_waited": uncovered,
        "steps": args.steps,
        "forward_profile_by_package_ms": dict(sorted(by_package.items(), key=lambda kv: -kv[1])),
        "forward_profile_total_ms": round(sum(by_package.values()), 3),
        "forward_profile_top": rows[:40],
    }


def _sleep_rate(torch: Any) -> float:
    """GPU sleep cycles per millisecond (the fastest of three readings)."""
    cycles, readings = 5_000_000, []
    for _ in range(3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        readings.append(begin.elapsed_time(end))
    return cycles / max(min(readings), 1e-3)


def write_report(results: list[dict[str, Any]], out: Path, model: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"host-profile-{model}.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# Host issue time against device time, one training step ({model})",
        "",
        "Generated by `benchmarks/host_profile.py`. Medians over the timed steps, ms. A phase whose issue time is",
        "above its device time is host-bound there. `waited`: measurements whose device sleep ran out first.",
        "",
        "| variant | phase | device ms | host issue ms | host / device | waited |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | – | – | – | – | {r['error'][:120]} |")
            continue
        for p in PHASES:
            dev, host = r["device_ms"][p], r["host_issue_ms"][p]
            lines.append(
                f"| {r['variant']} | {p} | {dev:.2f} | {host:.2f} | {host / dev:.2f} | {r['host_waited'][p]} |"
            )
    for r in results:
        if "error" in r:
            continue
        lines += [
            "",
            f"## {r['variant']}: the forward's issue under Python's profiler ({r['forward_profile_total_ms']:.1f} ms, profiler included)",
            "",
        ]
        lines += [f"- {k}: {v:.1f} ms" for k, v in r["forward_profile_by_package_ms"].items() if v >= 0.1]
        lines += ["", "Top functions by own time:", ""]
        lines += [
            f"- {row['self_ms']:.2f} ms, {row['calls']} calls: `{row['function']}`"
            for row in r["forward_profile_top"][:15]
        ]
    (out / f"host-profile-{model}.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--variants", default="adapt,compile")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in this process (the child's role)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; variants: {', '.join(VARIANTS)}")
    out = Path(args.out)
    if args.variant:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"host-profile-{args.model}-{args.variant}.json").write_text(json.dumps(run_variant(args), indent=1))
        return 0
    results = []
    for variant in args.variants.split(","):
        child = [sys.executable, __file__, "--out", str(out), "--model", args.model, "--variant", variant,
                 "--batch", str(args.batch), "--seq", str(args.seq), "--warmup", str(args.warmup),
                 "--steps", str(args.steps)]  # fmt: skip
        env = {**os.environ, **VARIANT_ENV.get(variant, {})}
        done = subprocess.run(child, capture_output=True, text=True, env=env)
        path = out / f"host-profile-{args.model}-{variant}.json"
        if done.returncode == 0 and path.exists():
            results.append(json.loads(path.read_text()))
            path.unlink()
        else:
            results.append({"variant": variant, "error": (done.stderr.strip().splitlines() or ["failed"])[-1]})
        print(variant, "done", file=sys.stderr)
    write_report(results, out, args.model)
    print((out / f"host-profile-{args.model}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
