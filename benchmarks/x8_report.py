"""What the runs of ``benchmarks/x8.py`` say: parity with the one-process reference, measured throughput,
prediction error before and after calibration, and the Markdown report of it all."""

from __future__ import annotations

import math
import statistics

import torch

from benchmarks.x8_layouts import ModeConfig


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
