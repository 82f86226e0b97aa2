"""One training step, side by side: HF eager, torch.compile, Liger and adapt, on one device, in one call.

    PYTHONPATH=$PWD python benchmarks/e2e.py --out benchmarks/results                  # the H200 run (< 9 min)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/e2e.py --out DIR --tiny       # CPU rehearsal at toy sizes

Models (random weights from transformers configs, saved once with ``save_pretrained`` so every variant
loads the same weights and adapt's operators stage reads a real checkpoint): the Llama-3.2-1B shape, the
Gemma-2-2B shape, and Qwen3-30B-A3B's width at 3 layers with 128 experts top-8.

Per model, first the operators stage exactly as ``adapt run`` calls it (``operators.run_ops``), in a
process of its own with an empty timing cache (cold), then again in a fresh process (warm); its plan is
what the adapt variants apply, through ``operators.adapt_model``.  Then every variant in its own process:

* ``eager``: the HF model as adapt loads it.   * ``compile``: ``model.compile()`` (whole model).
* ``compile-flex``: ``compile`` over transformers' FlexAttention path (a soft-cap applied in the kernel; GPU only).
* ``eager-again``: eager once more, in its own process: its loss curve's drift from eager's is run-to-run noise.
* ``liger``: ``apply_liger_kernel_to_<type>()`` where Liger has that entry point (import guarded).
* ``adapt``: the plan's kernels and its compilation (the default adapted configuration).
* ``adapt-eager``: the plan's kernels, not compiled.   * ``adapt-whole``: kernels, whole model compiled.
* ``adapt-cudagraphs``: ``adapt-adamw`` with its compiled graphs replayed as CUDA graphs (``mode="reduce-overhead"``).
* ``adapt-selective``: ``adapt`` with selective recomputation (``operators.recompute``): each block keeps only its
  matmul and attention outputs.  ``adapt-selective-loss1g``: that, and the fused loss's logits chunk at 1 GiB
  instead of 256 MiB (fewer, larger chunk GEMMs, spending memory the recomputation freed); ``adapt-loss1g``: the
  larger chunks alone.
* ``adapt-adamw`` / ``adapt-selective-adamw``: ``adapt`` / ``adapt-selective`` stepped by adapt's AdamW kernel
  (``operators.optim.TritonAdamW``) instead of torch's fused AdamW: the only variants whose loop differs.
* ``adapt-inductor-ops``: ``adapt-adamw`` with the kernels registered as ``triton_op`` (``ADAPT_KERNEL_OPS=inductor`` in
  its process): Inductor compiles and launches them from its own code instead of calling an opaque operator.
* ``compile-blocks``: no kernels, every block compiled (the plan's compile mode on the unpatched model).
* ``loss-whole``: only the plan's loss head (fused linear cross-entropy), whole model compiled: whether the plan's
  other kernels help or hurt once Inductor sees the rest.

Same loop for all (but the optimizer of the ``-adamw`` variants and ``adapt-cudagraphs``): bf16 weights, AdamW (fused on CUDA, foreach on CPU), the HF forward with ``labels``,
``--warmup`` steps, then ``--steps`` timed steps (CUDA events), tokens/s, MFU (6 x active params +
6 x layers x heads x head_dim x seq per token, against 989 TFLOP/s), peak memory, step-time spread and
every step's loss.  ``--profile`` adds a torch-profiler summary per variant: top kernels by device
time and the device's idle share; ``--memory`` what is allocated at one step's peak, grouped by who allocated it
(``benchmarks/memory_peak.py``).  The operators stage is timed as ``adapt run`` runs it: after intake, which pays
the process's transformers imports (its time is reported beside).  A total budget bounds the run: a variant that does not fit in
what is left is skipped and the report says so.  Writes ``e2e-h200.{json,md}`` (``e2e-cpu-tiny`` with
``--tiny``) into ``--out``.

This file is the parent: it schedules the jobs under one budget and writes the report; each job runs in a
process of its own (``benchmarks/e2e_worker.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.e2e_worker import VARIANT_ENV, worker
from benchmarks.gap_sources import gap_lines
from benchmarks.memory_peak import memory_lines
from benchmarks.shapes import SHAPES
from benchmarks.step_profile import profile_lines

MODELS = SHAPES  # the reference shapes (benchmarks/shapes.py) this benchmark measures
VARIANTS = (
    "eager",
    "eager-again",  # eager in a second process: its drift from eager is the run-to-run noise (atomics, autotuning)
    "compile",
    "compile-flex",  # torch.compile over transformers' FlexAttention path: the fast faithful baseline for capped attention
    "liger",
    "adapt",
    "adapt-eager",
    "compile-blocks",
    "adapt-whole",
    "loss-whole",
    "adapt-cudagraphs",
    "adapt-selective",
    "adapt-selective-loss1g",
    "adapt-loss1g",
    "adapt-adamw",
    "adapt-selective-adamw",
    "adapt-inductor-ops",
)
DEFAULT_VARIANTS = ("eager", "compile", "liger", "adapt", "adapt-eager")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_job(args: argparse.Namespace, model: str, job: str, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    out = Path(args.out)
    result_path = out / "e2e-work" / model / f"{job}.json"
    result_path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--out",
        str(out),
        "--model",
        model,
        "--job",
        job,
        "--variant",
        job,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--lr",
        str(args.lr),
        "--variant-budget-s",
        str(max(5.0, timeout_s - 30)),
    ]
    cmd += ["--tiny"] * args.tiny + ["--profile"] * args.profile + ["--ops-light"] * args.ops_light
    cmd += ["--memory"] * args.memory + ["--gaps"] * args.gaps
    start = time.perf_counter()
    log_path = out / "e2e-work" / model / f"{job}.log"
    with open(log_path, "w") as log_file:
        try:
            subprocess.run(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {
                "ok": False,
                "error": f"no result within {timeout_s:.0f} s",
                "wall_s": round(time.perf_counter() - start, 1),
            }
    wall = round(time.perf_counter() - start, 1)
    if not result_path.is_file():
        tail = log_path.read_text()[-300:].strip().splitlines()
        return {
            "ok": False,
            "error": f"the process wrote no result: {tail[-1] if tail else 'no output'}",
            "wall_s": wall,
        }
    return {**json.loads(result_path.read_text()), "wall_s": wall}


def main_parent(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget_s
    models = args.models.split(",")
    variants = args.variants.split(",")
    for name in models + variants:
        if name not in MODELS and name not in VARIANTS:
            print(
                f"unknown model or variant {name!r}; models: {', '.join(MODELS)}; variants: {', '.join(VARIANTS)}",
                file=sys.stderr,
            )
            return 2
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    report: dict[str, Any] = {
        "budget_s": args.budget_s,
        "batch": args.batch,
        "seq": args.seq,
        "warmup": args.warmup,
        "steps": args.steps,
        "lr": args.lr,
        "tiny": args.tiny,
        "models": {},
        "ops_cold_means": "adapt's timing cache empty (a fresh ADAPT_CACHE); Triton's and Inductor's caches as found",
    }
    previous = out / f"{_stem(args)}.json"
    if args.merge and previous.is_file():  # keep the other models' entries of an earlier call
        report["models"] = {
            k: v for k, v in json.loads(previous.read_text()).get("models", {}).items() if k not in models
        }
    # Each model gets an equal share of what is left when its turn comes, so a slow model cannot starve the next.
    for index, model in enumerate(models):
        work = out / "e2e-work" / model
        work.mkdir(parents=True, exist_ok=True)
        share = (deadline - time.perf_counter()) / (len(models) - index)
        model_deadline = time.perf_counter() + share
        entry: dict[str, Any] = {
            "variants": {},
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "lr": args.lr,
            "steps": args.steps,
        }
        report["models"][model] = entry
        cache = work / "adapt-cache"
        env_model = {**env, "ADAPT_CACHE": str(cache)}
        if cache.exists():
            import shutil

            shutil.rmtree(cache)
        # adapt first, then the other variants in the order asked (the budget may end before the last), then
        # the warm operators stage.
        jobs = ["checkpoint", "ops-cold", *sorted(variants, key=lambda v: v != "adapt"), "ops-warm"]
        for job in jobs:
            left = model_deadline - time.perf_counter()
            cap = {"checkpoint": 120.0, "ops-cold": args.ops_timeout_s, "ops-warm": args.ops_timeout_s}.get(
                job, args.variant_timeout_s
            )
            timeout = min(cap, left)
            if timeout < 20:
                result = {"ok": False, "skipped": f"budget spent ({left:.0f} s left for this model)"}
            else:
                log(f"{model}: {job} (up to {timeout:.0f} s)")
                result = run_job(args, model, job, timeout, {**env_model, **VARIANT_ENV.get(job, {})})
            log(f"{model}: {job} -> {_brief(result)}")
            if job == "checkpoint":
                if not result.get("ok"):
                    entry["error"] = f"checkpoint: {result.get('error')}"
                    break
            elif job.startswith("ops"):
                entry[job] = result
            else:
                entry["variants"][job] = result
    write_report(report, out, args)
    return 0


def _brief(result: dict[str, Any]) -> str:
    if not result.get("ok"):
        return result.get("skipped") or result.get("error") or "failed"
    if "tokens_per_s" in result:
        return f"{result['tokens_per_s']:,.0f} tok/s, step cv {result['step_s_cv'] or 0:.3f}, {result['wall_s']} s"
    if "seconds" in result:
        return f"{result['seconds']} s {result['phases']}"
    return f"ok ({result['wall_s']} s)"


BF16_EPS = 2.0**-8  # bf16's relative rounding step: a loss this far apart is within one bf16 rounding of it
# what a user would run instead of adapt: the adapted variants are compared with the fastest of these
BASELINES = ("eager", "eager-again", "compile", "liger")
# other orderings of the same bf16 sums, or the same program run again: their drift from eager is the noise
TRUSTED_BASELINES = ("compile", "liger", "eager-again")


def _largest_gap(losses: list[float], reference: list[float], steps: int) -> float:
    return max(abs(a - b) for a, b in zip(losses[:steps], reference[:steps]))


def loss_tracking_lines(report: dict[str, Any]) -> list[str]:
    """Each variant's losses against eager's, step by step (same weights, same batches).

    The noise over the first n steps is the larger of one bf16 rounding step of the loss and the largest
    gap over those steps of a trusted baseline that ran them (torch.compile, Liger): those reorder the same
    bf16 arithmetic, so their drift from eager is what bf16 noise amounts to there.  A variant tracks eager
    when its own gap stays within that; steps no trusted baseline ran are judged against the rounding step
    alone, and the line says so.
    """
    lines = ["", "## Loss against eager, step by step (same weights and batches)", ""]
    for model, entry in report["models"].items():
        reference = (entry["variants"].get("eager") or {}).get("losses")
        if not reference:
            lines.append(f"- {model}: no eager run in this report, so no loss is judged")
            continue
        rounding = BF16_EPS * max(abs(b) for b in reference)
        trusted = {
            name: v["losses"][: len(reference)]
            for name, v in entry["variants"].items()
            if name in TRUSTED_BASELINES and v.get("losses")
        }
        lines.append(
            f"- {model} eager (lr {entry.get('lr', report.get('lr'))}): {len(reference)} steps, loss "
            f"{reference[0]:.4f} -> {reference[-1]:.4f}; one bf16 step of the loss {rounding:.4f}"
        )
        for name, v in entry["variants"].items():
            if name == "eager" or not v.get("losses"):
                continue
            steps = min(len(v["losses"]), len(reference))
            gap = _largest_gap(v["losses"], reference, steps)
            floors = {
                t: _largest_gap(ls, reference, steps) for t, ls in trusted.items() if t != name and len(ls) >= steps
            }
            noise = max([rounding, *floors.values()])
            why = ", ".join(f"{t} {g:.4f}" for t, g in floors.items()) or "no trusted baseline ran these steps"
            verdict = "tracks eager" if gap <= noise else "BEYOND the noise"
            lines.append(f"  - {name}: {steps} steps, largest gap {gap:.4f}, noise {noise:.4f} ({why}): {verdict}")
    return lines


def _stem(args: argparse.Namespace) -> str:
    return "e2e-cpu-tiny" if args.tiny else "e2e-h200"


def _setup_note(variant: dict) -> str:
    """How an adapt variant was set up beyond its kernels: compilation, recomputation, loss chunk budget."""
    parts = [f"compile {variant['compile_mode']}"] if variant.get("compile_mode") else []
    if variant.get("recompute", "none") != "none":
        parts.append(f"recompute {variant['recompute']}")
    if variant.get("optimizer", "").startswith("adapt"):
        parts.append(variant["optimizer"])
    if variant.get("loss_chunk_budget_bytes"):
        parts.append(f"loss chunks {variant['loss_chunk_budget_bytes'] / 2**20:.0f} MiB")
    return ", ".join(parts)


def _per_model(report: dict[str, Any], key: str) -> str:
    """One run setting (``steps``, ``lr``) as the models ran it: one value, or each model's where they differ."""
    values = {model: entry.get(key, report.get(key)) for model, entry in report["models"].items()}
    if len(set(values.values())) <= 1:
        return f"{next(iter(values.values()), report.get(key))}"
    return ", ".join(f"{v} for {model}" for model, v in values.items())


def gap_report_lines(report: dict[str, Any]) -> list[str]:
    """Per variant traced with ``--gaps``: the host's work during the device's idle gaps."""
    lines = [
        line
        for model, entry in report["models"].items()
        for name, v in entry["variants"].items()
        if v.get("gaps")
        for line in gap_lines(model, name, v["gaps"])
    ]
    return ["", "## What the host did while the device waited", "", *lines] if lines else []


def write_report(report: dict[str, Any], out: Path, args: argparse.Namespace) -> None:
    stem = _stem(args)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    lines = [
        f"# One training step, side by side ({'CPU rehearsal, toy sizes' if args.tiny else 'one H200'})",
        "",
        (
            f"batch {args.batch} x {args.seq}, {args.warmup} warm-up steps, up to {_per_model(report, 'steps')} "
            f"timed steps; bf16, AdamW (lr {_per_model(report, 'lr')}) fused (CUDA) / foreach (CPU), HF forward with labels. MFU: 6 x active params + 6 x L x H x seq per token, 989 TFLOP/s."
        ),
        "",
    ]
    lines += [
        "| model | variant | tokens/s | vs best baseline | MFU | peak GiB | step cv | steps | first step s | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, entry in report["models"].items():
        variants = entry["variants"]
        baselines = [v["tokens_per_s"] for k, v in variants.items() if k in BASELINES and v.get("ok")]
        best = max(baselines) if baselines else None
        for name, v in variants.items():
            if not v.get("ok"):
                lines.append(f"| {model} | {name} | – | – | – | – | – | – | – | {v.get('skipped') or v.get('error')} |")
                continue
            ratio = f"x{v['tokens_per_s'] / best:.3f}" if best else "–"
            mfu = f"{v['mfu']:.1%}" if v.get("mfu") is not None else "–"
            peak = f"{v['peak_memory_gib']:.1f}" if v.get("peak_memory_gib") is not None else "–"
            note = v.get("stopped_early") or _setup_note(v)
            lines.append(
                f"| {model} | {name} | {v['tokens_per_s']:,.0f} | {ratio} | {mfu} | {peak} | {v['step_s_cv'] or 0:.3f} | "
                f"{v['steps_timed']} | {v['first_step_s']:.1f} | {note} |"
            )
    notes = [f"- {model}: {entry['note']}" for model, entry in report["models"].items() if entry.get("note")]
    lines += ["", *notes] if notes else []
    lines += [
        "",
        "## Operators stage (the plan the adapt variants applied)",
        "",
        "| model | cold s | cold plan s by kind | warm s | warm phases | compile | intake s before it (cold, warm) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, entry in report["models"].items():
        cold, warm = entry.get("ops-cold", {}), entry.get("ops-warm", {})
        intake = ", ".join(str(job.get("intake_seconds", "–")) for job in (cold, warm))
        by_kind = ", ".join(f"{k} {v:.1f}" for k, v in cold.get("plan_seconds_by_kind", {}).items() if v >= 0.1)
        lines.append(
            f"| {model} | {cold.get('seconds', cold.get('error', '–'))} | {by_kind or '–'} | "
            f"{warm.get('seconds', warm.get('error', '–'))} | {warm.get('phases', '–')} | "
            f"{(warm.get('compile') or cold.get('compile') or {}).get('mode', '–')} | {intake} |"
        )
    lines += [
        "",
        "## Timed kernel choices (ms per candidate; margin = best other / chosen, below 1 when chosen for memory)",
        "",
    ]
    for model, entry in report["models"].items():
        groups: dict[tuple[str, str, str], list[str]] = {}
        for choice in (entry.get("ops-cold") or {}).get("choices", []):
            if choice["timings_ms"]:
                timings = ", ".join(f"{k} {v:.3f}" for k, v in choice["timings_ms"].items())
                key = (choice["kind"], choice["kernel"], f"{timings}; margin x{choice['margin']}")
                groups.setdefault(key, []).append(choice["module"])
        for (kind, kernel, timed), modules in groups.items():
            where = f"`{modules[0]}`" + (f" and {len(modules) - 1} more alike" if len(modules) > 1 else "")
            lines.append(f"- {model} {where} ({kind}): {kernel} chosen; {timed}")
    lines += loss_tracking_lines(report)
    lines += profile_lines(report)
    lines += memory_lines(report)
    lines += gap_report_lines(report)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    log(f"wrote {out / stem}.json and .md")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for e2e-h200.{json,md} (work files go to OUT/e2e-work)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (rehearsal)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--lr", type=float, default=1e-5, help="AdamW's learning rate (timing does not depend on it; loss curves do)"
    )
    parser.add_argument("--budget-s", type=float, default=530.0, help="total wall-clock budget (default 530 s)")
    parser.add_argument("--variant-timeout-s", type=float, default=150.0, help="one variant's limit, compile included")
    parser.add_argument("--ops-timeout-s", type=float, default=150.0, help="one operators-stage run's limit")
    parser.add_argument("--ops-light", action="store_true", help="operators stage without ONNX export and patch check")
    parser.add_argument("--profile", action="store_true", help="add a torch-profiler summary per variant")
    parser.add_argument(
        "--memory", action="store_true", help="add what is allocated at one step's peak, by origin, per variant"
    )
    parser.add_argument(
        "--merge", action="store_true", help="keep the other models' entries of an earlier report in --out"
    )
    parser.add_argument(
        "--gaps",
        action="store_true",
        help="add the host's work during each device idle gap (benchmarks/gap_sources.py)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--variant-budget-s", type=float, default=600.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = (2, 32, 1, 2) if args.tiny else (4, 2048, 4, 20)
    for name, value in zip(("batch", "seq", "warmup", "steps"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
