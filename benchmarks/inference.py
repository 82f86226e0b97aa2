"""Decode speed and generation alignment on one GPU: HF eager, HF static cache + compile, adapt's decode path.

    PYTHONPATH=$PWD python benchmarks/inference.py --out DIR            # the H200 run (< 8 minutes)
    PYTHONPATH=$PWD python benchmarks/inference.py --out DIR --tiny     # CPU rehearsal at toy sizes

Two shapes, random weights from their transformers configs, saved with ``save_pretrained`` and
loaded through HF's own loader: the anchors' Llama-3.2-1B (hidden 2048, ffn 8192, 16 layers,
32/8 heads of 64, vocab 128256, tied) and Gemma-2-2B (hidden 2304, ffn 9216, 26 layers, 8/4
heads of 256, vocab 256000, tied, sliding window 4096 on alternate layers).  In bf16, a prompt of
512 random tokens and 256 greedy new tokens at batch 1 and 8:

* ``hf-eager``: ``generate()`` with the dynamic cache;
* ``hf-static-compile``: ``generate(cache_implementation="static")``, which transformers compiles;
* ``adapted``: the kernel plan applied, then ``validators.decode.StaticDecoder`` (static cache,
  decode step under ``torch.compile(mode="reduce-overhead")``).

The kernel plan comes from the operators stage run once per shape on the saved checkpoint, so its
kernels are timed on this device.  Prefill and decode are timed separately (medians over repeats
after a warm-up that compiles).
Then ``validators.generation.generation_check`` runs on both shapes: the adapted model in bf16
against the unadapted one in float32 on the GPU.  Each variant runs in its own subprocess with its
own time limit, inside a total budget; a failure is recorded and the run goes on.  Writes
``inference-h200.{json,md}`` (``inference-tiny.*`` with ``--tiny``) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.shapes import build_checkpoint

ROOT = Path(__file__).resolve().parents[1]
INFERENCE_SHAPES = ("llama-1b", "gemma2-2b")  # reference shapes from benchmarks/shapes.py
DECODE_VARIANTS = ("hf-eager", "hf-static-compile", "adapted")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sizes(tiny: bool) -> dict[str, Any]:
    if tiny:
        return {"prompt": 16, "new_tokens": 8, "batches": (1, 2), "repeats": 1, "gen_tokens": 8, "gen_prompts": 2}
    return {"prompt": 512, "new_tokens": 256, "batches": (1, 8), "repeats": 3, "gen_tokens": 64, "gen_prompts": 3}


# ---- work done inside one subprocess ----------------------------------------------------------


def make_kernel_plan(path: Path) -> None:
    """The operators stage on the saved checkpoint (its kernels timed on this device), kept for the other children."""
    from operators import run_ops

    report = run_ops(str(path), onnx=False, check_patch=False)
    (path / "kernel-plan.json").write_text(json.dumps(report.plan.to_dict()))
    patched = [c for c in report.plan.components if c.patch]
    log(f"  kernel plan: {len(patched)} of {len(report.plan.components)} components patched ({report.seconds:.0f} s)")


def _kernel_plan(path: Path) -> Any:
    from operators.mapping import KernelPlan

    return KernelPlan.from_dict(json.loads((path / "kernel-plan.json").read_text()))  # written by make_kernel_plan


def decode_variant(variant: str, path: Path, tiny: bool) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from validators.decode import time_hf_generate, time_static_decoder

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = sizes(tiny)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    notes: list[str] = []
    if variant == "adapted":
        from operators import apply_kernel_plan

        handle = apply_kernel_plan(model, _kernel_plan(path))
        if not handle.patched:
            raise RuntimeError("the kernel plan patched nothing: 'adapted' would be the unmodified model")
        notes.append(f"kernel plan patched {len(handle.patched)} modules")
    vocab = model.get_input_embeddings().num_embeddings
    rows = []
    for batch in size["batches"]:
        ids = torch.randint(0, vocab, (batch, size["prompt"]), generator=torch.Generator().manual_seed(batch)).to(
            device
        )
        if variant == "adapted":
            timing = time_static_decoder(variant, model, ids, size["new_tokens"], repeats=size["repeats"])
        else:
            timing = time_hf_generate(
                variant, model, ids, size["new_tokens"], static=variant == "hf-static-compile", repeats=size["repeats"]
            )
        timing.notes = notes + timing.notes
        rows.append(timing.to_dict())
        log(
            f"  {variant} batch {batch}: prefill {timing.prefill_s * 1e3:.1f} ms, decode {timing.decode_tokens_per_s:,.0f} tok/s"
        )
    return {"rows": rows}


def alignment_variant(path: Path, tiny: bool) -> dict[str, Any]:
    import torch

    from adapt.model.intake import resolve_source
    from validators.generation import GenerationOptions, generation_check

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = sizes(tiny)
    options = GenerationOptions(prompts=size["gen_prompts"], prompt_len=32, new_tokens=size["gen_tokens"])
    report = generation_check(
        resolve_source(str(path)), _kernel_plan(path), dtype="bf16", device=device, options=options
    )
    log(f"  generation: {report.verdict}: {report.summary()}")
    return report.to_dict()


def child(args: argparse.Namespace) -> None:
    path = Path(args.checkpoint)
    if args.variant == "build":
        import torch

        build_checkpoint(args.shape, path, args.tiny, "cuda" if torch.cuda.is_available() else "cpu")
        result: dict[str, Any] = {"built": str(path)}
    elif args.variant == "plan":
        make_kernel_plan(path)
        result = {"plan": str(path / "kernel-plan.pickle")}
    elif args.variant == "generation":
        result = alignment_variant(path, args.tiny)
    else:
        result = decode_variant(args.variant, path, args.tiny)
    Path(args.result).write_text(json.dumps(result))


# ---- the orchestrating process -----------------------------------------------------------------


def run_child(variant: str, shape: str, checkpoint: Path, tiny: bool, limit_s: float, work: Path) -> dict[str, Any]:
    result = work / f"{shape}-{variant}.json"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--shape",
        shape,
        "--checkpoint",
        str(checkpoint),
        "--result",
        str(result),
    ]
    cmd += ["--tiny"] if tiny else []
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=max(limit_s, 1), capture_output=True, text=True, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {limit_s:.0f} s"}
    seconds = time.perf_counter() - started
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0 or not result.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail), "seconds": seconds}
    data = json.loads(result.read_text())
    data["seconds"] = seconds
    return data


def orchestrate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "inference-tiny" if args.tiny else "inference-h200"
    deadline = time.perf_counter() + args.budget_s
    results: dict[str, Any] = {
        "sizes": sizes(args.tiny),
        "shapes": {},
        "budget_s": args.budget_s,
        "environment": environment(),
    }
    # Per-variant shares of the budget: compiling variants need the most.
    shares = {
        "build": 0.04,
        "plan": 0.1,
        "hf-eager": 0.08,
        "hf-static-compile": 0.12,
        "adapted": 0.12,
        "generation": 0.06,
    }
    with tempfile.TemporaryDirectory(dir=args.work) as work_dir:
        work = Path(work_dir)
        for shape in INFERENCE_SHAPES:
            entry: dict[str, Any] = {}
            results["shapes"][shape] = entry
            checkpoint = work / shape
            for variant in ("build", "plan", *DECODE_VARIANTS, "generation"):
                left = deadline - time.perf_counter()
                if left < 5:
                    entry[variant] = {"error": "not run: the time budget was spent"}
                    continue
                limit = min(left, max(60.0, shares[variant] * args.budget_s * 1.5))
                log(f"{shape}: {variant} (limit {limit:.0f} s)")
                entry[variant] = run_child(variant, shape, checkpoint, args.tiny, limit, work)
                if variant in ("build", "plan") and "error" in entry[variant]:
                    break
                write(out, stem, results)
    write(out, stem, results)
    log(f"wrote {out / (stem + '.json')} and {out / (stem + '.md')}")
    return 0


def environment() -> dict[str, Any]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}  # fmt: skip


def _rate(entry: dict[str, Any], variant: str, batch: int) -> dict[str, Any] | None:
    rows = entry.get(variant, {}).get("rows") or []
    return next((r for r in rows if r["batch"] == batch), None)


def write(out: Path, stem: str, results: dict[str, Any]) -> None:
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    env, size = results["environment"], results["sizes"]
    lines = [f"# Decode speed and generation alignment ({env['device']})", "",
             (f"torch {env['torch']}, transformers {env['transformers']}; bf16, prompt {size['prompt']}, "
              f"{size['new_tokens']} new tokens; decode tokens/s count the tokens after the first."), "",
             "| shape | batch | HF eager tok/s | HF static+compile tok/s | adapted tok/s | adapted / static | adapted / eager | prefill ms (eager / static / adapted) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for shape, entry in results["shapes"].items():
        for batch in size["batches"]:
            eager, static, adapted = (_rate(entry, v, batch) for v in DECODE_VARIANTS)

            def tps(row):
                return f"{row['decode_tokens_per_s']:,.0f}" if row else "error"

            def ratio(a, b):
                return (
                    f"{a['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}x"
                    if a and b and b["decode_tokens_per_s"]
                    else "-"
                )

            prefill = " / ".join(f"{r['prefill_s'] * 1e3:.1f}" if r else "-" for r in (eager, static, adapted))
            lines.append(f"| {shape} | {batch} | {tps(eager)} | {tps(static)} | {tps(adapted)} | {ratio(adapted, static)} | "
                         f"{ratio(adapted, eager)} | {prefill} |")  # fmt: skip
    lines += [
        "",
        "## Generation alignment (adapted bf16 against the unadapted model: float32 on a GPU, float64 on the CPU)",
        "",
    ]
    for shape, entry in results["shapes"].items():
        gen = entry.get("generation", {})
        lines.append(
            f"- {shape}: "
            + (
                f"**{gen['verdict']}**: {gen['summary']}"
                if "verdict" in gen
                else f"error: {gen.get('error', 'not run')}"
            )
        )
    errors = [
        (shape, v, d["error"])
        for shape, e in results["shapes"].items()
        for v, d in e.items()
        if isinstance(d, dict) and "error" in d
    ]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {shape} {variant}: {error}" for shape, variant, error in errors]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for inference-h200.{json,md}")
    parser.add_argument("--tiny", action="store_true", help="toy sizes, CPU rehearsal")
    parser.add_argument("--budget-s", type=float, default=450.0, help="total time budget (default 450 s)")
    parser.add_argument("--work", default=None, help="where the checkpoints go (default: the system temp dir)")
    parser.add_argument("--child", dest="variant", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        try:
            child(args)
        except Exception:  # noqa: BLE001 - the parent records the failure from the exit status and the traceback
            traceback.print_exc()
            return 1
        return 0
    if not args.out:
        parser.error("--out DIR is required")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
