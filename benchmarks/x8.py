"""The eight-rank layouts, trained through adapt's realisation and checked against the planner.

Two modes, one set of layouts (FSDP x8 ZeRO-3; TP2 x FSDP4; PP2 x TP2 x FSDP2; the planner's first-ranked
layout; EP8 and EP4 x FSDP2 on an MoE model):

    python benchmarks/x8.py --device cpu     # gloo, 8 CPU processes, tiny widths: fp32 loss + weight parity
    python benchmarks/x8.py --device cuda    # NCCL on 8 GPUs: Llama-3.2-1B shape and a truncated Qwen3-MoE
    python benchmarks/x8.py --device cuda --dry-run   # plans and predictions only; calibration path on CPU

Every layout is the plan the planner itself emits for that pinned layout (``plan_parallel(fixed=...)``), so
the prediction and the measurement describe the same thing.  The realisation refuses to split tied
embeddings over pipeline stages, so the PP layout trains the same Llama shape untied (own reference).  Each runs under ``torchrun`` through
``adapt.runtime.runner.prepare`` and adapt's trainer, from the same seed and the same global
batches as a one-process reference; per-step losses (and on CPU the gathered final weights) are compared.
CUDA mode then times each block of the model on one GPU, writes that in the planner's calibration format,
re-predicts every layout with it and reports the prediction error before and after.

This file drives the runs (torchrun groups, the references, calibration); the shapes, layouts and the planner's
plans are in ``benchmarks/x8_layouts.py``, parity and the report in ``benchmarks/x8_report.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from adapt.core.errors import BadInput
from adapt.model.intake import build_spec, inspect, load_model, resolve_source
from adapt.runtime import checkpoint
from adapt.runtime.runner import init_distributed, prepare
from adapt.runtime.trainer import TrainConfig, set_determinism
from benchmarks.x8_calibration import calibrate
from benchmarks.x8_layouts import (
    CPU,
    CPU_MODELS,
    CUDA,
    CUDA_MODELS,
    LAYOUTS,
    ModeConfig,
    layout_name,
    plan_layouts,
    predict_fixed,
    write_config,
)
from benchmarks.x8_report import markdown, measure, merge, parity, rel_error, with_mean_errors
from parallel_planner.calibration import load_calibration
from parallel_planner.catalog import gpu_type
from parallel_planner.plan import ParallelPlan
from parallel_planner.profile import profile_model

RESULTS = REPO / "benchmarks" / "results"

# NVLink SHARP / multicast stay off on the lent machines (see the device notes).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def worker(cases_file: str, names: list[str], out_dir: str) -> None:
    """Inside torchrun: train each named case; a failing rank leaves its traceback for the driver."""
    device = init_distributed()
    if device.type == "cpu":
        torch.set_num_threads(1)  # eight processes share the cores
    cases = json.loads(Path(cases_file).read_text())
    for name in names:
        try:
            train_case(name, cases[name], device, Path(out_dir))
        except Exception:
            (Path(out_dir) / f"{name}.rank{dist.get_rank()}.err").write_text(traceback.format_exc())
            raise
    dist.destroy_process_group()


def train_case(name: str, case: dict, device, out_dir: Path) -> None:
    """Load, parallelise and train one case from the shared seed; rank 0 saves what every rank measured."""
    plan = ParallelPlan.from_dict(case["plan"])
    steps = case["steps"]
    config = TrainConfig(steps=steps, lr=2e-3 if device.type == "cpu" else 3e-4, warmup_steps=2, seed=0)
    set_determinism(0, deterministic=False)  # config-only models initialise from this seed
    src = resolve_source(case["source"])
    with torch.device(device):  # random init straight on the GPU
        model = load_model(src, dtype=torch.float32, device=device.type)
    spec = build_spec(src, model=model) if plan.tp > 1 else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    run = prepare(model, plan, config, spec=spec)
    initial = checkpoint.gather_full_state_dict(run.pmodel) if case.get("gather_params") else None
    metrics = [run.trainer.train_step().to_dict() for _ in range(steps)]
    # CUDA: allocator peak of this GPU; CPU: the process's peak resident set (not comparable to a GPU figure)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else metrics[-1]["peak_memory_gib"]
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    params = checkpoint.gather_full_state_dict(run.pmodel) if case.get("gather_params") else None
    if dist.get_rank() == 0:
        torch.save({"steps": metrics, "peak_memory_gib_per_rank": peaks, "params": params, "initial": initial,
                    "world_size": dist.get_world_size()}, out_dir / f"{name}.pt")  # fmt: skip
    del run, model, params, initial
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()


def launch_group(nproc: int, names: list[str], cases_file: Path, out: Path, cuda: bool, timeout: int) -> dict:
    """One torchrun group; returns {case: result or {"error": ...}} (stale results are deleted first)."""
    for name in names:
        for stale in [out / f"{name}.pt", *out.glob(f"{name}.rank*.err")]:
            stale.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_VERBOSITY": "error"}
    env.update(NCCL_ENV if cuda else {"OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           "--worker", str(cases_file), str(out), *names]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        error = f"rc={proc.returncode}: {proc.stderr[-4000:]}" if proc.returncode else ""
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout} s"
    found = {}
    for name in names:
        path = out / f"{name}.pt"
        # the root cause, not the ranks that only saw a peer die
        texts = sorted((p.read_text() for p in out.glob(f"{name}.rank*.err")), key=lambda t: "closed by peer" in t)
        why = texts[0][-3000:] if texts else error or "no result (an earlier case in the group failed)"
        found[name] = torch.load(path, weights_only=False) if path.is_file() else {"error": why}
    return found


def reference_case(model: str, source: Path, mode: ModeConfig, gather: bool) -> dict:
    plan = ParallelPlan(seq_len=mode.seq_len, global_batch=mode.global_batch, precision=mode.precision,
                        micro_batch=mode.micro_batch, grad_accum=mode.global_batch // mode.micro_batch)  # fmt: skip
    return {"model": model, "source": str(source), "plan": plan.to_dict(), "steps": mode.parity_steps,
            "gather_params": gather}  # fmt: skip


def run_mode(mode: ModeConfig, models: dict, only: list[str] | None, timeout: int, scratch: Path) -> dict:
    """Plan, train every layout and its one-process reference, compare; returns the report."""
    cuda = mode.device == "cuda"
    sources = {name: write_config(name, fields, scratch) for name, fields in models.items()}
    cases = plan_layouts(sources, mode)
    selected = [c for c in cases if not only or c in only]
    for name in cases:
        cases[name].update(steps=mode.warmup_steps + mode.timed_steps, gather_params=not cuda)
    refs = {f"ref_{m}": reference_case(m, sources[m], mode, not cuda) for m in {cases[c]["model"] for c in selected}}
    cases_file = scratch / "cases.json"
    cases_file.write_text(json.dumps({**cases, **refs}))
    out = scratch / "results"
    out.mkdir()
    started = time.perf_counter()
    results = {}  # one group per case: a failing layout cannot take the others down, and memory starts clean
    for name in selected:
        results.update(launch_group(8, [name], cases_file, out, cuda, timeout))
    results.update(launch_group(1, list(refs), cases_file, out, cuda, timeout))
    specs = {m: inspect(str(p)) for m, p in sources.items()}
    peak = gpu_type("h200").peak_flops("bf16")
    report: dict = {
        "mode": mode.device, "torch": torch.__version__, "config": {k: v for k, v in vars(mode).items()},
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (gloo, 8 processes)",
        "models": models, "layouts": {}, "wall_s": None,
    }  # fmt: skip
    for name in selected:
        case, got = cases[name], results[name]
        ref = results[f"ref_{case['model']}"]
        flops = profile_model(specs[case["model"]]).model_flops_per_token(mode.seq_len)
        measured = measure(got, mode, flops, 8, peak) if cuda else {}
        entry = {k: case[k] for k in ("model", "plan", "planner_rank", "skipped_ranks", "fixed", "predicted")}
        entry.update(layout=layout_name(case["plan"]), parity=parity(got, ref, mode), measured=measured,
                     losses=[s["loss"] for s in got.get("steps", [])], error=got.get("error"))  # fmt: skip
        if measured:
            entry["prediction_error"] = {
                "tokens_per_s": rel_error(case["predicted"]["tokens_per_s"], measured["tokens_per_s"]),
                "memory_gib_per_gpu": rel_error(case["predicted"]["memory_gib_per_gpu"],
                                                max(measured["peak_memory_gib_per_rank"])),
            }  # fmt: skip
        report["layouts"][name] = entry
    report["references"] = {name: {"plan": refs[name]["plan"], "losses": [s["loss"] for s in results[name].get("steps", [])],
                                   "error": results[name].get("error")} for name in refs}  # fmt: skip
    report["wall_s"] = time.perf_counter() - started
    if cuda:  # the measurements stand even if timing the blocks fails; say why instead
        try:
            report["calibration"] = calibration_pass(report, cases, sources, specs, mode, scratch, "cuda")
        except (RuntimeError, KeyError, ValueError, BadInput):  # CUDA/autograd, a hook that never fired, planner
            report["calibration"] = {"error": traceback.format_exc()[-3000:]}
    return report


def calibration_pass(report: dict, cases: dict, sources: dict, specs: dict, mode: ModeConfig, scratch: Path,
                     device: str) -> dict:  # fmt: skip
    """Measured per-block times -> calibration files -> re-predicted layouts; error before and after."""
    files = {m: calibrate(sources[m], mode, scratch / f"calibration_{m}.json", device) for m in sources
             if any(e["model"] == m for e in report["layouts"].values())}  # fmt: skip
    summary: dict = {"files": {m: json.loads(p.read_text()) for m, p in files.items()}, "layouts": {}}
    for name, entry in report["layouts"].items():
        again = predict_fixed(cases[name], specs[entry["model"]], mode, load_calibration(files[entry["model"]]))
        measured = entry["measured"].get("tokens_per_s")
        summary["layouts"][name] = {"predicted_calibrated": again, "error_after": rel_error(again["tokens_per_s"], measured),
                                    "error_before": rel_error(entry["predicted"]["tokens_per_s"], measured)}  # fmt: skip
    return with_mean_errors(summary)


def dry_run(scratch: Path) -> dict:
    """Everything but the 8-GPU training: the H200 plans and predictions for the real shapes, and the
    calibration path (time blocks, write, load, re-predict) exercised on the tiny CPU models."""
    cuda_sources = {n: write_config(n, f, scratch / "cuda") for n, f in CUDA_MODELS.items()}
    cuda_cases = plan_layouts(cuda_sources, CUDA)
    tiny_sources = {n: write_config(n, f, scratch / "cpu") for n, f in CPU_MODELS.items()}
    tiny_cases = plan_layouts(tiny_sources, CPU)
    report = {"h200_plans": {n: {"layout": layout_name(c["plan"]), **{k: c[k] for k in ("planner_rank", "predicted")}}
                             for n, c in cuda_cases.items()}}  # fmt: skip
    specs = {m: inspect(str(p)) for m, p in tiny_sources.items()}
    unmeasured = {"layouts": {n: {"model": c["model"], "predicted": c["predicted"], "measured": {}}
                              for n, c in tiny_cases.items()}}  # fmt: skip
    report["calibration_path_cpu"] = calibration_pass(unmeasured, tiny_cases, tiny_sources, specs, CPU, scratch, "cpu")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), required=False)
    parser.add_argument("--dry-run", action="store_true", help="plans, predictions and the calibration path only")
    parser.add_argument("--only", nargs="+", choices=list(LAYOUTS), help="run these layouts only")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per torchrun group (one layout)")
    parser.add_argument("--out", help="result stem (default benchmarks/results/x8-cpu-gloo or x8-h200)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[2:], args.worker[1])
        return 0
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with tempfile.TemporaryDirectory() as tmp:
        if args.dry_run:
            print(json.dumps(dry_run(Path(tmp)), indent=2, default=str))
            return 0
        if args.device is None:
            parser.error("--device is required (or --dry-run)")
        if args.device == "cuda":
            if torch.cuda.device_count() < 8:
                print(f"--device cuda needs 8 GPUs; found {torch.cuda.device_count()}", file=sys.stderr)
                return 2
            os.environ.update(NCCL_ENV)
        mode, models = (CUDA, CUDA_MODELS) if args.device == "cuda" else (CPU, CPU_MODELS)
        report = run_mode(mode, models, args.only, args.timeout, Path(tmp))
    stem = Path(args.out) if args.out else RESULTS / ("x8-h200" if args.device == "cuda" else "x8-cpu-gloo")
    stem.parent.mkdir(parents=True, exist_ok=True)
    if args.only and stem.with_suffix(".json").is_file():  # a run split over several calls adds up
        report = merge(json.loads(stem.with_suffix(".json").read_text()), report)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    failed = [n for n, e in report["layouts"].items() if not e["parity"]["ok"]]
    if failed:
        print("parity failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
