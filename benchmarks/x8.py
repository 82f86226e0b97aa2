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
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from x8_calibration import calibrate  # noqa: E402  (beside this script)

from adapt.core.errors import BadInput
from adapt.model.intake import build_spec, inspect, load_model, resolve_source
from adapt.runtime import checkpoint
from adapt.runtime.runner import init_distributed, prepare
from adapt.runtime.trainer import TrainConfig, set_determinism
from parallel_planner.calibration import load_calibration
from parallel_planner.catalog import gpu_type
from parallel_planner.cluster import make_cluster
from parallel_planner.plan import ParallelPlan
from parallel_planner.profile import profile_model
from parallel_planner.search import plan_parallel
from parallel_planner.workload import Workload

RESULTS = REPO / "benchmarks" / "results"

# NVLink SHARP / multicast stay off on the lent machines (see the device notes).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# Model shapes.  Tiny CPU widths keep 8 gloo processes on 2 cores inside minutes; 8 heads / 4 kv heads
# so that tp=2 (and tp=4) divide them, 4 layers so that pp=2 stages hold two each, 8 experts for EP8.
CPU_MODELS = {
    "llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "tie_word_embeddings": True, "max_position_embeddings": 256},
    "qwen3_moe": {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "max_position_embeddings": 256},
}  # fmt: skip
# Llama-3.2-1B as in shared/anchors.md; Qwen3-30B-A3B widths with the depth cut to fit one GPU's reference run.
CUDA_MODELS = {
    "llama": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
              "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
              "tie_word_embeddings": True, "max_position_embeddings": 8192},
    "qwen3_moe": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "moe_intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                  "norm_topk_prob": True, "max_position_embeddings": 8192},
}  # fmt: skip

# Tied embeddings (as Llama-3.2-1B has) cannot be split over pipeline stages by the realisation, so the
# pipelined layout trains the same shape untied, against its own one-process reference.
CPU_MODELS["llama_untied"] = {**CPU_MODELS["llama"], "tie_word_embeddings": False}
CUDA_MODELS["llama_untied"] = {**CUDA_MODELS["llama"], "tie_word_embeddings": False}

# case -> (model, knobs pinned in the planner; None = the planner's own first choice)
LAYOUTS: dict[str, tuple[str, dict | None]] = {
    "fsdp8_zero3": ("llama", {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "ep": 1, "zero": 3}),
    "tp2_fsdp4": ("llama", {"tp": 2, "pp": 1, "dp": 4, "cp": 1, "ep": 1, "zero": 3}),
    "pp2_tp2_fsdp2": ("llama_untied", {"tp": 2, "pp": 2, "dp": 2, "cp": 1, "ep": 1, "zero": 3, "vpp": 1, "schedule": "1f1b"}),
    "planner_top": ("llama", None),
    "ep8": ("qwen3_moe", {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "ep": 8, "zero": 3}),
    "ep4_fsdp2": ("qwen3_moe", {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "ep": 4, "zero": 3}),
}  # fmt: skip


@dataclass(frozen=True)
class ModeConfig:
    device: str
    seq_len: int
    global_batch: int
    micro_batch: int  # pinned in the planner, so every layout's micro-batches have one shape
    warmup_steps: int  # untimed steps (their losses still count for parity)
    timed_steps: int
    parity_steps: int
    loss_rtol: float
    param_tol: dict = field(default_factory=dict)  # empty: weights are not compared
    precision: str = "fp32"


CPU = ModeConfig("cpu", seq_len=32, global_batch=8, micro_batch=1, warmup_steps=0, timed_steps=5, parity_steps=5,
                 loss_rtol=1e-5, param_tol={"rtol": 1e-4, "atol": 2e-5})  # fmt: skip
CUDA = ModeConfig("cuda", seq_len=2048, global_batch=32, micro_batch=4, warmup_steps=5, timed_steps=30,
                  parity_steps=5, loss_rtol=2e-2, precision="bf16")  # fmt: skip


def write_config(name: str, fields: dict, root: Path) -> Path:
    """A config-only model directory: every run initialises it randomly from the same seed (then rank 0's
    weights are broadcast), on CPU exactly as on the GPUs."""
    fields = dict(fields)
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(root / name)
    return root / name


def realisable_here(plan, device: str) -> str:
    """Why the realisation cannot run ``plan`` on ``device`` ('' when it can)."""
    if device == "cpu" and plan.cp > 1:
        return "context parallelism needs CUDA"
    if device == "cpu" and plan.offload_optimizer:
        return "optimizer offload needs CUDA"
    if plan.ep > 1 and plan.tp > 1:
        return "ep with tp is not realised"
    return ""


def plan_layouts(sources: dict[str, Path], mode: ModeConfig, gpu: str = "h200") -> dict[str, dict]:
    """Each case's plan and the planner's prediction for it (8 GPUs of ``gpu``)."""
    cluster, workload = make_cluster(gpu, 8), Workload(mode.seq_len, mode.global_batch)
    specs = {name: inspect(str(path)) for name, path in sources.items()}
    cases = {}
    for case, (model, pinned) in LAYOUTS.items():
        fixed = None if pinned is None else {"recompute": "none", "mbs": mode.micro_batch, "offload": 0, **pinned}
        ranked = plan_parallel(specs[model], cluster, workload, fixed=fixed, top_k=20).plans
        # Unpinned: the first-ranked layout this device can realise; say what was passed over.
        why = [realisable_here(c.plan, mode.device) if pinned is None else "" for c in ranked]
        first = next((i for i, reason in enumerate(why) if not reason), 0)
        chosen, skipped = ranked[first], [{"rank": c.rank, "why": r} for c, r in zip(ranked[:first], why)]
        plan = chosen.plan
        plan.precision = mode.precision
        cases[case] = {
            "model": model, "source": str(sources[model]), "plan": plan.to_dict(), "planner_rank": chosen.rank,
            "skipped_ranks": skipped, "predicted": _prediction(chosen), "fixed": fixed,
        }  # fmt: skip
    return cases


def _prediction(ranked) -> dict:
    return {"tokens_per_s": ranked.tokens_per_s, "mfu": ranked.mfu, "memory_gib_per_gpu": ranked.memory_gib_per_gpu,
            "step_time_s": ranked.step_time_s, "fits": ranked.fits}  # fmt: skip


def predict_fixed(case: dict, spec, mode: ModeConfig, calibration, gpu: str = "h200") -> dict:
    """Re-predict one case's layout (with a calibration this time)."""
    p = case["plan"]
    fixed = {"tp": p["tp"], "pp": p["pp"], "dp": p["dp"], "cp": p["cp"], "ep": p["ep"], "zero": p["zero"],
             "recompute": p["recompute"], "mbs": p["micro_batch"], "vpp": p["vpp"], "schedule": p["pp_schedule"],
             "offload": int(p["offload_optimizer"])}  # fmt: skip
    result = plan_parallel(spec, make_cluster(gpu, 8), Workload(mode.seq_len, mode.global_batch), fixed=fixed,
                           top_k=1, calibration=calibration)  # fmt: skip
    return _prediction(result.plans[0])


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


def parity(got: dict, ref: dict, mode: ModeConfig) -> dict:
    """Per-step loss (and, where gathered, final weight) agreement with the one-process reference."""
    if "error" in got or "error" in ref:
        return {"ok": False, "error": got.get("error") or f"reference: {ref.get('error')}"}
    n = mode.parity_steps
    losses = [s["loss"] for s in got["steps"][:n]]
    ref_losses = [s["loss"] for s in ref["steps"][:n]]
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    out = {"losses": losses, "reference_losses": ref_losses, "loss_max_rel_diff": max(rel),
           "loss_ok": len(losses) == n and all(math.isfinite(x) for x in losses) and max(rel) <= mode.loss_rtol}  # fmt: skip
    if mode.param_tol and got.get("params") is not None and ref.get("params") is not None:
        worst, name_worst, ok = 0.0, "", got["params"].keys() == ref["params"].keys()
        for name, value in ref["params"].items():
            diff = (got["params"][name].float() - value.float()).abs()
            excess = (diff - mode.param_tol["atol"] - mode.param_tol["rtol"] * value.float().abs()).max().item()
            ok &= excess <= 0
            if diff.max().item() >= worst:
                worst, name_worst = diff.max().item(), name
        # Same start, and a comparison that means something only if training moved the weights.
        same_start = all(torch.equal(got["initial"][k], v) for k, v in ref["initial"].items())
        moved = max((ref["params"][k] - v).abs().max().item() for k, v in ref["initial"].items())
        out.update(params_ok=bool(ok) and same_start and moved > 1e-3, params_max_abs_diff=worst,
                   params_worst_tensor=name_worst, same_initial_weights=same_start, reference_weights_moved=moved)  # fmt: skip
    out["ok"] = out["loss_ok"] and out.get("params_ok", True)
    return out


def measure(got: dict, mode: ModeConfig, flops_per_token: float, gpus: int, peak_flops: float) -> dict:
    if "error" in got:
        return {}
    timed = got["steps"][mode.warmup_steps :]
    tps = statistics.median(s["tokens_per_s"] for s in timed)
    return {"tokens_per_s": tps, "step_time_s": statistics.median(s["step_time_s"] for s in timed),
            "mfu": tps * flops_per_token / (peak_flops * gpus), "timed_steps": len(timed),
            "peak_memory_gib_per_rank": got["peak_memory_gib_per_rank"]}  # fmt: skip


def rel_error(predicted: float, measured: float | None) -> float | None:
    return None if not measured else (predicted - measured) / measured


def layout_name(plan: dict) -> str:
    parts = [f"{k.upper()}{plan[k]}" for k in ("pp", "tp", "cp") if plan[k] > 1]
    if plan["ep"] > 1:  # experts borrow the data-parallel ranks: ep-way sharded, dp/ep-way replicated
        parts.append(
            f"EP{plan['ep']}" + (f" (expert-DP {plan['dp'] // plan['ep']})" if plan["dp"] > plan["ep"] else "")
        )
    parts.append(f"FSDP{plan['dp']} ZeRO-{plan['zero']}" if plan["dp"] > 1 else "")
    extra = [f"mbs{plan['micro_batch']}", f"ga{plan['grad_accum']}"]
    if plan["pp"] > 1:
        extra.append(plan["pp_schedule"] + (f" v{plan['vpp']}" if plan["vpp"] > 1 else ""))
    if plan["recompute"] != "none":
        extra.append(f"recompute={plan['recompute']}")
    return " x ".join(p for p in parts if p) + f" ({', '.join(extra)})"


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


def with_mean_errors(summary: dict) -> dict:
    rows = [r for r in summary["layouts"].values() if r["error_before"] is not None]
    for when in ("before", "after"):
        errors = [abs(r[f"error_{when}"]) for r in rows]
        summary[f"mean_abs_error_{when}"] = statistics.mean(errors) if errors else None
    return summary


def merge(previous: dict, report: dict) -> dict:
    """``report`` laid over an earlier (partial) report of the same mode; calibration means recomputed."""
    if previous.get("mode") != report["mode"]:
        return report
    for key in ("layouts", "references"):
        report[key] = {**previous.get(key, {}), **report[key]}
    report["wall_s"] += previous.get("wall_s") or 0
    if "layouts" in report.get("calibration", {}):
        cal, old = report["calibration"], previous.get("calibration", {})
        cal["files"] = {**old.get("files", {}), **cal["files"]}
        cal["layouts"] = {**old.get("layouts", {}), **cal["layouts"]}
        with_mean_errors(cal)
    return report


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:+.1f}%"


def markdown(report: dict) -> str:
    cuda = report["mode"] == "cuda"
    c = report["config"]
    lines = [f"# Eight-rank layouts, {report['device']}", "",
             f"torch {report['torch']}; seq {c['seq_len']}, global batch {c['global_batch']}, {c['precision']}; "
             f"{c['warmup_steps'] + c['timed_steps']} steps per layout; parity over the first {c['parity_steps']} steps "
             f"against a one-process run (loss rtol {c['loss_rtol']:g}"
             + (f", weights rtol {c['param_tol']['rtol']:g} atol {c['param_tol']['atol']:g}" if c["param_tol"] else "")
             + f"). Wall time {report['wall_s']:.0f} s.", ""]  # fmt: skip
    if not cuda:
        lines += ["CPU mode checks correctness only: eight processes share two cores, so its timings mean nothing.", ""]
    head = "| case | model | layout | loss max rel diff | weights max abs diff | parity |"
    if cuda:
        head += " tokens/s (pred) | MFU (pred) | peak GiB/GPU (pred) | tok/s error | after calibration |"
    lines += [head, "|" + " --- |" * (head.count("|") - 1)]
    for name, e in report["layouts"].items():
        p = e["parity"]
        weights = f"{p['params_max_abs_diff']:.2e}" if "params_max_abs_diff" in p else "–"
        last_line = p["error"].strip().splitlines()[-1][:120] if p.get("error") else ""
        verdict = "pass" if p["ok"] else "**FAIL**" + (f" ({last_line})" if last_line else "")
        ranked = f" (planner's #{e['planner_rank']})" if e["fixed"] is None else ""
        row = (f"| {name} | {e['model']} | {e['layout']}{ranked} | "
               f"{p.get('loss_max_rel_diff', float('nan')):.2e} | {weights} | {verdict} |")  # fmt: skip
        if cuda:
            m, pr = e["measured"], e["predicted"]
            cal = report.get("calibration", {}).get("layouts", {}).get(name, {})
            row += (f" {m.get('tokens_per_s', 0):,.0f} ({pr['tokens_per_s']:,.0f}) | {m.get('mfu', 0):.1%} ({pr['mfu']:.1%}) |"
                    f" {max(m.get('peak_memory_gib_per_rank') or [0]):.1f} ({pr['memory_gib_per_gpu']:.1f}) |"
                    f" {_pct(e.get('prediction_error', {}).get('tokens_per_s'))} | {_pct(cal.get('error_after'))} |")  # fmt: skip
        lines.append(row)
    moved = [
        e["parity"]["reference_weights_moved"]
        for e in report["layouts"].values()
        if "same_initial_weights" in e["parity"]
    ]
    if moved:
        same = all(e["parity"].get("same_initial_weights") for e in report["layouts"].values())
        lines += ["", (f"Initial weights: {'bitwise identical to' if same else '**different from**'} the reference's in "
                       f"every layout. Largest weight change of each reference over the run: {min(moved):.1e} to "
                       f"{max(moved):.1e} (weight tolerance: atol {c['param_tol']['atol']:g}).")]  # fmt: skip
    skipped = {n: e["skipped_ranks"] for n, e in report["layouts"].items() if e["skipped_ranks"]}
    if skipped:
        lines += ["", "Planner-ranked layouts passed over because this device cannot realise them: "
                  + "; ".join(f"{n}: " + ", ".join(f"rank {s['rank']} ({s['why']})" for s in v) for n, v in skipped.items())]  # fmt: skip
    cal = report.get("calibration") or {}
    if cal.get("error"):
        lines += ["", f"Calibration failed: {cal['error'].strip().splitlines()[-1]}"]
    elif cal.get("mean_abs_error_before") is not None:
        lines += ["", (f"Mean |tokens/s prediction error|: {100 * cal['mean_abs_error_before']:.1f}% before calibration, "
                       f"{100 * cal['mean_abs_error_after']:.1f}% after feeding the measured per-block times back. "
                       "Predicted memory includes the planner's 1 GiB CUDA-context reserve; measured is the allocator "
                       "peak (torch.cuda.max_memory_allocated) of each GPU.")]  # fmt: skip
    return "\n".join(lines) + "\n"


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
