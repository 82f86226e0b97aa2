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

from adapt.app.pipeline.options import LOCAL_CLUSTER, RunOptions


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
    """Fails only on what would make the model wrong: tensors the model needs but the checkpoint lacks.

    Unexpected tensors (e.g. a saved ``position_ids`` buffer) are reported: transformers'
    loader ignores them too.  Shape mismatches never get here: intake rejects them as bad input.
    """
    ckpt = spec.get("checkpoint") or {}
    problems = [f"missing tensor {n}" for n in ckpt.get("missing", [])]
    problems += [f"shape mismatch {m.get('name', m)}" for m in ckpt.get("shape_mismatches", [])]
    unexpected = list(ckpt.get("unexpected", []))
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
        "features": spec.get("features", []),
        "unrecognized": spec.get("unrecognized", []),
        "checkpoint_problems": problems,
        "checkpoint_unexpected": unexpected,
    }
    kinds = sorted({f"{b['attention']}/{b['mlp']}" for b in blocks})
    verdict = (
        f"{spec.get('model_class')}: {spec.get('num_layers')} blocks ({', '.join(kinds)}), "
        f"{_human(params.get('total'))} params, {_plural(len(data['novelties']), 'novelty', 'novelties')}"
    )
    if problems:
        verdict += f"; checkpoint: {problems[0]}" + (f" (+{len(problems) - 1})" if len(problems) > 1 else "")
    if unexpected:
        verdict += f"; {_plural(len(unexpected), 'unused checkpoint tensor', 'unused checkpoint tensors')}"
    return Summary(not problems, verdict, data)


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


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
    op_status_counts = dict(Counter(o.get("status") for o in report.get("ops", [])))
    unmapped = coverage.get("unmapped")
    unsupported = status_counts.get("unsupported", 0) + op_status_counts.get("unsupported", 0)
    patch = report.get("patch_check") or {}
    patch_ok = not patch.get("ran") or bool(patch.get("passed"))
    fast = _num(coverage.get("flops_share_fused_or_native"))
    data = {
        "components": components,
        "status_counts": status_counts,
        "op_status_counts": op_status_counts,
        "coverage": coverage,
        "fast_flop_share": fast,
        "new": report.get("new", []),
        "ops": report.get("ops", []),
        "onnx": report.get("onnx"),
        "generated": report.get("generated", []),
        "patch_check": patch,
        "profile": (report.get("profile") or {}).get("name"),
    }
    passed = unmapped == 0 and unsupported == 0 and patch_ok
    verdict = (
        f"{len(components)} components ({', '.join(f'{n} {s}' for s, n in sorted(status_counts.items()))}), "
        f"{coverage.get('ops_total', '?')} ops, unmapped {unmapped if unmapped is not None else '?'}, "
        f"unsupported {unsupported}, FLOPs on fused/native paths {_pct(fast)}"
    )
    if patch.get("ran"):
        verdict += f", patched model {'matches' if patch_ok else 'DIFFERS FROM'} unpatched"
    return Summary(passed, verdict, data)


# ---- plan ---------------------------------------------------------------------------------------

_PLAN_FIELDS = (
    "tp", "pp", "dp", "cp", "ep", "zero", "recompute", "micro_batch", "grad_accum", "vpp",
    "memory_gib_per_gpu", "step_time_s", "tokens_per_s", "mfu", "hfu",
)  # fmt: skip


def plan(result: dict[str, Any], options: RunOptions) -> Summary:
    plans = result.get("plans", [])
    ranked = [{k: p.get(k) for k in _PLAN_FIELDS} for p in plans]
    best = plans[0] if plans else None
    cluster = _cluster_label(result.get("cluster") or {}, options)
    data = {
        "cluster": cluster,
        "workload": {
            "seq_len": options.plan.plan_seq_len,
            "global_batch": options.plan.plan_global_batch,
            "precision": options.plan.precision,
        },
        "plans": ranked,
        "best": {
            **ranked[0],
            "memory_breakdown": best.get("memory_breakdown", {}),
            "time_breakdown": best.get("time_breakdown", {}),
            "command": best.get("torchrun"),
        }
        if best
        else None,
        "binding_constraint": result.get("binding_constraint"),
        "searched": result.get("searched"),
        "feasible": result.get("feasible"),
    }
    if not best or not best.get("fits", True):
        return Summary(False, f"no layout fits {cluster}: {result.get('binding_constraint')}", data)
    layout = " ".join(f"{k}={best.get(k)}" for k in ("tp", "pp", "dp", "cp", "ep", "zero"))
    verdict = (
        f"{cluster}: {layout}, {_fmt(best.get('memory_gib_per_gpu'), '.1f')} GiB/GPU, "
        f"{_fmt(best.get('tokens_per_s'), ',.0f')} tok/s, MFU {_pct(_num(best.get('mfu')))}"
    )
    return Summary(True, verdict, data)


def _cluster_label(cluster: dict[str, Any], options: RunOptions) -> str:
    """``--cluster`` as given; ``local`` also names the GPUs it measured (``local (1xH200)``)."""
    if options.plan.cluster != LOCAL_CLUSTER or not cluster:
        return str(options.plan.cluster)
    return f"{options.plan.cluster} ({cluster.get('num_gpus')}x{str(cluster['gpu'].get('name', '?')).upper()})"


def _fmt(value: Any, spec: str) -> str:
    number = _num(value)
    return "?" if number is None else format(number, spec)


def replan(result: dict[str, Any], options: RunOptions) -> Summary:
    """The plan before and after this machine's measurements; a measurement that does not apply passes, saying why."""
    before, after = result.get("before") or {}, result.get("after")
    data = {k: result.get(k) for k in ("applied", "reason", "device", "target", "before", "after")}
    data["changes"] = list(result.get("changes") or [])
    data["measured_runs"] = list(result.get("measured_runs") or [])
    if not result.get("applied") or not after:
        return Summary(True, f"plan unchanged: {result.get('reason')}", data)
    verdict = (
        f"{result.get('reason')}; step {_fmt(before.get('step_time_s'), '.3g')} s -> "
        f"{_fmt(after.get('step_time_s'), '.3g')} s, {_fmt(before.get('tokens_per_s'), ',.0f')} -> "
        f"{_fmt(after.get('tokens_per_s'), ',.0f')} tok/s; {data['changes'][0] if data['changes'] else ''}"
    )
    return Summary(True, verdict, data)


# ---- environment ------------------------------------------------------------------------------


def environment(report: dict[str, Any], options: RunOptions) -> Summary:
    problems = list(report.get("problems", []))
    unchecked = list(report.get("unchecked", []))
    measured = {
        k: report.get(k) for k in ("copy_gbps", "matmul_tflops", "matmul_dtype", "allreduce_gbps") if k in report
    }
    data = {
        "versions": report.get("versions", {}),
        "device_type": report.get("device_type"),
        "devices": report.get("devices", []),
        "measured": measured,
        "problems": problems,
        "unchecked": unchecked,
        "plan_target": report.get("plan_target"),
        "judged_against_plan": report.get("judged_against_plan"),
    }
    passed = bool(report.get("passed", False))
    rate = measured.get("matmul_tflops")
    verdict = f"{data['device_type'] or options.validation.device}: {len(problems)} problem(s)" + (
        f" ({problems[0]})" if problems else ""
    )
    if rate is not None:
        verdict += f", matmul {rate:.2f} TFLOP/s {measured.get('matmul_dtype', '')}"
    if data["plan_target"] and not data["judged_against_plan"]:
        verdict += f"; the plan for {data['plan_target']} is not judged on this machine"
    if unchecked:
        verdict += f"; {len(unchecked)} check(s) not possible here"
    return Summary(passed, verdict, data)


# ---- alignment -----------------------------------------------------------------------------------

_LAYER_FIELDS = (
    "name",
    "block",
    "component",
    "cosine",
    "rel_err",
    "max_abs",
    "err_ratio",
    "baseline_rel_err",
    "passed",
)


def alignment(report: dict[str, Any], options: RunOptions) -> Summary:
    layers = [{k: layer.get(k) for k in _LAYER_FIELDS} for layer in report.get("layers", [])]
    gradients = [{k: g.get(k) for k in _LAYER_FIELDS} for g in report.get("gradients", [])]
    failed = [layer for layer in layers if not layer["passed"]]
    parity = report.get("parity")
    data = {
        "dtype": report.get("dtype", options.validation.dtype),
        "device": report.get("device", options.validation.device),
        "reference_dtype": report.get("reference_dtype"),
        "seed": report.get("seed"),
        "first_divergent": report.get("first_divergent"),
        "first_divergent_block": report.get("first_divergent_block"),
        "first_divergent_component": report.get("first_divergent_component"),
        "nonfinite_module": report.get("nonfinite_module"),
        "thresholds": report.get("thresholds"),
        "layers": layers,
        "gradients": gradients,
        "parity": parity,
        "shapes": {"seq_len": options.validation.seq_len, "batch_size": options.validation.batch_size},
    }
    passed = bool(report.get("passed", False))
    worst = max(layers, key=lambda layer: _num(layer["rel_err"]) or 0.0, default=None)
    verdict = f"{len(layers) - len(failed)}/{len(layers)} tensors within {data['dtype']} limits"
    if gradients:
        verdict += f", {sum(bool(g['passed']) for g in gradients)}/{len(gradients)} gradients"
    if parity:
        verdict += f", loss parity {'ok' if parity.get('passed') else 'FAILED'} over {parity.get('steps')} steps"
    if data["nonfinite_module"]:
        verdict += f"; NaN/Inf first produced by {data['nonfinite_module']}"
    elif data["first_divergent"]:
        verdict += f"; first divergent: {data['first_divergent']}"
    elif worst is not None:
        verdict += f"; worst rel err {_fmt(worst['rel_err'], '.2e')} ({worst['name']})"
    parity_failed = bool(parity) and not parity.get("passed")
    if not passed and not (data["nonfinite_module"] or data["first_divergent"] or parity_failed):
        # every count above can read as a pass: say first why it is not one
        reason = report.get("inconclusive") or "no tensor was judged"
        verdict = f"not passed ({reason}); " + verdict
    return Summary(passed, verdict, data)


# ---- throughput --------------------------------------------------------------------------------


# (metric key in a variant, label, unit, scale, higher is better)
_THROUGHPUT_METRICS = (
    ("train_tokens_per_s", "train step", "tokens/s", 1.0, True),
    ("prefill_tokens_per_s", "prefill", "tokens/s", 1.0, True),
    ("decode_tokens_per_s", "decode", "tokens/s", 1.0, True),
    ("mfu", "MFU", "fraction", 1.0, True),
    ("train_step_s", "train step time", "s", 1.0, False),
    ("peak_memory_bytes", "peak memory", "MiB", 1.0 / 2**20, False),
)


def throughput(report: dict[str, Any], options: RunOptions) -> Summary:
    variants = {v["name"]: v for v in report.get("variants", [])}
    baseline, adapted, compiled = variants.get("eager"), variants.get("adapted"), variants.get("compiled")
    rows = []
    for key, label, unit, scale, higher_better in _THROUGHPUT_METRICS:
        values = {
            name: (_num(v.get(key)) * scale if _num(v.get(key)) is not None else None)
            for name, v in (("baseline", baseline), ("adapted", adapted), ("compiled", compiled))
            if v is not None
        }
        if all(value is None for value in values.values()):
            continue
        row = {"metric": label, "unit": unit, **values}
        base, new = values.get("baseline"), values.get("adapted")
        if higher_better and base and new is not None:
            row["speedup"] = new / base
        rows.append(row)
    data = {
        "device": report.get("device", options.validation.device),
        "device_name": report.get("device_name"),
        "dtype": report.get("dtype", options.validation.dtype),
        "rows": rows,
        "truncated": report.get("truncated"),
        "layers_measured": report.get("layers_measured"),
        "peak_flops_basis": report.get("peak_flops_basis"),
        "calibration": report.get("calibration"),
        "shapes": {
            "seq_len": report.get("seq_len", options.validation.seq_len),
            "batch_size": report.get("batch", options.validation.batch_size),
        },
    }
    speedups = [
        f"{r['metric']} x{r['speedup']:.2f}" for r in rows if r.get("speedup") is not None and r["unit"] == "tokens/s"
    ]
    data["verdict"], data["reasons"], data["decode"], data["decode_targets"] = (
        report.get("verdict"),
        report.get("reasons", []),
        report.get("decode", []),
        report.get("decode_targets", []),
    )
    verdict = f"adapted/eager on {data['device_name'] or data['device']}: " + (
        ", ".join(speedups) or "no comparable rates"
    )
    if data["verdict"] in ("failed", "inconclusive") and data["reasons"]:
        verdict = f"{data['verdict']} ({data['reasons'][0]}); {verdict}"  # the measured verdict and why, first
    elif data["verdict"] == "passed" and data["reasons"]:
        verdict = f"{data['reasons'][0]}; {verdict}"
    return Summary(bool(report.get("passed", False)) and data["verdict"] != "failed", verdict, data)


# ---- soak -------------------------------------------------------------------------------------------


def soak(report: dict[str, Any], options: RunOptions) -> Summary:
    timeline = [
        {k: step.get(k) for k in ("step", "loss", "grad_norm", "step_time_s", "allocated_bytes", "reserved_bytes")}
        for step in report.get("steps", [])
    ]
    data = {
        "device": report.get("device", options.validation.device),
        "dtype": report.get("dtype", options.validation.dtype),
        "steps": report.get("steps_done"),
        "steps_planned": report.get("steps_planned"),
        "resumed_from": report.get("resumed_from"),
        "checkpoints": report.get("checkpoints", []),
        "loss_finite": report.get("loss_finite"),
        "first_loss": (report.get("losses") or [None])[0],
        "last_loss": (report.get("losses") or [None])[-1],
        "step_time_cv": report.get("step_time_cv"),
        "step_time_drift": report.get("step_time_drift"),
        "memory_slope_bytes_per_step": report.get("memory_slope_bytes_per_step"),
        "leak": report.get("leak"),
        "timeline": timeline,
        "shapes": {"seq_len": options.validation.seq_len, "batch_size": options.validation.batch_size},
    }
    passed = bool(report.get("passed", False))
    slope = _num(data["memory_slope_bytes_per_step"])
    slope_mib = None if slope is None else slope / 2**20
    verdict = (
        f"{data['steps']}/{data['steps_planned']} steps, loss {_fmt(data['first_loss'], '.3f')} -> "
        f"{_fmt(data['last_loss'], '.3f')} ({'finite' if data['loss_finite'] else 'NON-FINITE'}), "
        f"step-time CV {_fmt(data['step_time_cv'], '.2f')}, "
        f"memory slope {_fmt(slope_mib, '.2f')} "
        f"MiB/step ({'LEAK' if data['leak'] else 'no leak'}), {len(data['checkpoints'])} checkpoints"
    )
    if data["resumed_from"] is not None:
        verdict += f", resumed from step {data['resumed_from']}"
    return Summary(passed, verdict, data)
