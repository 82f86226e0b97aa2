"""Each stage's ``to_dict()`` reduced to the normalised summary the reports render.

A summary keeps the stage's own verdict (its ``passed`` flag); it only selects and names the
fields that the report tables and plots need.  Keys a stage did not report stay absent, and the
report says "not reported" rather than showing a made-up value.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from adapt.pipeline.options import RunOptions


@dataclass
class Summary:
    passed: bool
    verdict: str  # one line
    data: dict[str, Any] = field(default_factory=dict)


def _num(value: Any) -> float | None:
    """A JSON number, or the validators' "inf"/None encodings of non-finite values."""
    if isinstance(value, bool) or value is None:
        return None if value is None else float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("inf", "-inf", "nan"):
        return float(value)
    return None


def _pct(share: float | None) -> str:
    return "n/a" if share is None or math.isnan(share) else f"{100 * share:.0f}%"


# ---- intake -----------------------------------------------------------------------------------


def intake(spec: dict[str, Any], options: RunOptions) -> Summary:
    ckpt = spec.get("checkpoint") or {}
    problems = [
        *(f"missing tensor {n}" for n in ckpt.get("missing", [])),
        *(f"unexpected tensor {n}" for n in ckpt.get("unexpected", [])),
        *(f"shape mismatch {m.get('name', m)}" for m in ckpt.get("shape_mismatches", [])),
    ]
    blocks = [
        {
            "index": b["index"],
            "module": b["module"],
            "mixer": b["mixer"],
            "attention": (b.get("attention") or {}).get("kind", "none"),
            "mlp": b["mlp"]["kind"],
            "norm": f"{b['norm']['kind']} ({b['norm']['placement']})",
            "params": b["params"],
        }
        for b in spec.get("blocks", [])
    ]
    params = spec.get("params", {})
    data = {
        "model_type": spec.get("model_type"),
        "architectures": spec.get("architectures", []),
        "model_class": spec.get("model_class"),
        "dtype": spec.get("dtype"),
        "is_causal": spec.get("is_causal"),
        "hidden_size": spec.get("hidden_size"),
        "num_layers": spec.get("num_layers"),
        "vocab_size": spec.get("vocab_size"),
        "params_total": params.get("total"),
        "params_active": params.get("active_per_token"),
        "blocks": blocks,
        "novelties": spec.get("novelties", []),
        "unrecognized": spec.get("unrecognized", []),
        "checkpoint_problems": problems,
    }
    kinds = sorted({f"{b['attention']}/{b['mlp']}" for b in blocks})
    verdict = (
        f"{spec.get('model_class')}: {spec.get('num_layers')} blocks ({', '.join(kinds)}), "
        f"{_human(params.get('total'))} params, {len(data['novelties'])} novelties"
    )
    if problems:
        verdict += f"; checkpoint: {problems[0]}" + (f" (+{len(problems) - 1})" if len(problems) > 1 else "")
    return Summary(not problems, verdict, data)


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


# ---- operators --------------------------------------------------------------------------------


def operators(report: dict[str, Any], options: RunOptions) -> Summary:
    components = [
        {k: c.get(k) for k in ("module", "kind", "provider", "kernel", "status")} for c in report.get("components", [])
    ]
    coverage = dict(report.get("coverage") or {})
    status_counts = dict(Counter(c["status"] for c in components))
    unmapped = coverage.get("unmapped")
    unsupported = status_counts.get("unsupported", 0)
    passed = bool(report.get("passed", unmapped == 0 and unsupported == 0))
    data = {
        "components": components,
        "status_counts": status_counts,
        "coverage": coverage,
        "new": report.get("new", []),
        "ops": report.get("ops", []),
        "onnx": report.get("onnx"),
        "profile": report.get("profile"),
    }
    fast = coverage.get("fast_flop_share", coverage.get("flops_fused_or_native"))
    verdict = (
        f"{len(components)} components ({', '.join(f'{n} {s}' for s, n in sorted(status_counts.items()))}), "
        f"{coverage.get('ops_total', '?')} ops, unmapped {unmapped if unmapped is not None else '?'}, "
        f"FLOPs on fused/native paths {_pct(_num(fast))}"
    )
    return Summary(passed, verdict, data)


# ---- plan ---------------------------------------------------------------------------------------

_PLAN_FIELDS = (
    "tp", "pp", "dp", "cp", "ep", "zero", "recompute", "micro_batch",
    "memory_gib_per_gpu", "step_time_s", "tokens_per_s", "mfu", "hfu",
)  # fmt: skip


def plan(result: dict[str, Any], options: RunOptions) -> Summary:
    plans = result.get("plans", [])
    ranked = [{k: p.get(k) for k in _PLAN_FIELDS} for p in plans]
    best = plans[0] if plans else None
    data = {
        "cluster": options.cluster,
        "workload": {"seq_len": options.plan_seq_len, "global_batch": options.plan_global_batch, "precision": options.precision},
        "plans": ranked,
        "best": {**ranked[0], "memory_breakdown": best.get("memory_breakdown", {}), "command": best.get("command")}
        if best
        else None,
        "binding_constraint": result.get("binding_constraint"),
    }
    if not best:
        return Summary(False, f"no layout fits {options.cluster}: {result.get('binding_constraint')}", data)
    layout = " ".join(f"{k}={best.get(k)}" for k in ("tp", "pp", "dp", "cp", "ep", "zero"))
    verdict = (
        f"{options.cluster}: {layout}, {_fmt(best.get('memory_gib_per_gpu'), '.1f')} GiB/GPU, "
        f"{_fmt(best.get('tokens_per_s'), ',.0f')} tok/s, MFU {_pct(_num(best.get('mfu')))}"
    )
    return Summary(True, verdict, data)


def _fmt(value: Any, spec: str) -> str:
    number = _num(value)
    return "?" if number is None else format(number, spec)


# ---- environment ------------------------------------------------------------------------------


def environment(report: dict[str, Any], options: RunOptions) -> Summary:
    problems = list(report.get("problems", []))
    unchecked = list(report.get("unchecked", report.get("not_checked", [])))
    data = {
        "versions": report.get("versions", {}),
        "devices": report.get("devices", []),
        "measured": report.get("measured", {}),
        "problems": problems,
        "unchecked": unchecked,
    }
    passed = bool(report.get("passed", not problems))
    verdict = f"{len(problems)} problem(s)" + (f": {problems[0]}" if problems else "")
    if unchecked:
        verdict += f"; not checked here: {len(unchecked)}"
    return Summary(passed, verdict, data)


# ---- alignment -----------------------------------------------------------------------------------

_LAYER_FIELDS = ("name", "block", "component", "cosine", "rel_err", "max_abs", "err_ratio", "baseline_rel_err", "passed")


def alignment(report: dict[str, Any], options: RunOptions) -> Summary:
    layers = [{k: layer.get(k) for k in _LAYER_FIELDS} for layer in report.get("layers", [])]
    failed = [layer for layer in layers if not layer["passed"]]
    data = {
        "dtype": report.get("dtype", options.candidate_dtype),
        "device": report.get("device", options.device),
        "first_divergent": report.get("first_divergent"),
        "nonfinite": report.get("nonfinite"),
        "thresholds": report.get("thresholds"),
        "layers": layers,
        "gradients": report.get("gradients", []),
        "loss_parity": report.get("loss_parity"),
        "shapes": {"seq_len": options.seq_len, "batch_size": options.batch_size},
    }
    passed = bool(report.get("passed", not failed))
    worst = max(layers, key=lambda l: _num(l["rel_err"]) or 0.0, default=None)
    verdict = f"{len(layers) - len(failed)}/{len(layers)} tensors within {data['dtype']} limits"
    if data["first_divergent"]:
        verdict += f"; first divergent: {data['first_divergent']}"
    elif worst is not None:
        verdict += f"; worst rel err {_fmt(worst['rel_err'], '.2e')} ({worst['name']})"
    return Summary(passed, verdict, data)


# ---- throughput --------------------------------------------------------------------------------


def throughput(report: dict[str, Any], options: RunOptions) -> Summary:
    rows = list(report.get("rows", report.get("results", [])))
    data = {
        "device": report.get("device", options.device),
        "dtype": report.get("dtype", options.candidate_dtype),
        "rows": rows,
        "speedup": report.get("speedup", {}),
        "calibration": report.get("calibration"),
        "truncated": report.get("truncated"),
        "shapes": {"seq_len": options.seq_len, "batch_size": options.batch_size, "steps": options.bench_steps},
    }
    speedups = {k: _num(v) for k, v in (data["speedup"] or {}).items()}
    verdict = ", ".join(f"{k} x{v:.2f}" for k, v in speedups.items() if v is not None) or f"{len(rows)} measurements"
    return Summary(bool(report.get("passed", True)), verdict, data)


# ---- soak -------------------------------------------------------------------------------------------


def soak(report: dict[str, Any], options: RunOptions) -> Summary:
    data = {
        "steps": report.get("steps", options.soak_steps),
        "timeline": report.get("timeline", {}),
        "loss_finite": report.get("loss_finite"),
        "step_time_cv": report.get("step_time_cv"),
        "leak": report.get("leak"),
        "checkpoints": report.get("checkpoints", []),
        "problems": report.get("problems", []),
    }
    passed = bool(report.get("passed", False))
    verdict = f"{data['steps']} steps, step-time CV {_fmt(data['step_time_cv'], '.2f')}, leak: {data['leak']}"
    return Summary(passed, verdict, data)
