"""pandas tables shared by the Markdown, HTML and matrix renderers (one builder per report table)."""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import Any

import pandas as pd

from adapt.core.stage_verdicts import recorded_decode_targets
from reports.schema import stage, summary

GIB = 1024**3


def stage_table(report: dict[str, Any]) -> pd.DataFrame:
    rows = [
        {
            "stage": s["name"],
            "status": s["status"],
            "time": _stage_time(s),
            "verdict": s.get("verdict", ""),
        }
        for s in report["stages"]
    ]
    return pd.DataFrame(rows, columns=["stage", "status", "time", "verdict"])


def _stage_time(entry: dict[str, Any]) -> str:
    """The measured duration; a cached stage keeps the time it took when it ran, marked as reused."""
    if entry["status"] in ("skipped", "pending", "blocked"):
        return ""
    measured = f"{entry.get('duration_s', 0):.1f}s"
    return f"{measured} (cached)" if entry.get("cached") else measured


def model_facts(report: dict[str, Any]) -> pd.DataFrame:
    intake = summary(report, "intake")
    keys = ("model_class", "architectures", "dtype", "is_causal", "num_layers", "hidden_size", "vocab_size",
            "params_total", "params_active")  # fmt: skip
    rows = [{"field": k, "value": _cell(intake.get(k))} for k in keys if k in intake]
    for key, label in (
        ("checkpoint_problems", "checkpoint problems"),
        ("checkpoint_unexpected", "unused checkpoint tensors"),
    ):
        if intake.get(key):
            rows.append({"field": label, "value": _cell(intake[key])})
    return pd.DataFrame(rows, columns=["field", "value"])


def block_groups(report: dict[str, Any]) -> pd.DataFrame:
    """Blocks grouped by composition, so a 61-layer model reads as two or three rows."""
    blocks = summary(report, "intake").get("blocks", [])
    if not blocks:
        return pd.DataFrame(columns=["blocks", "mixer", "attention", "mlp", "norm", "params/block"])
    df = pd.DataFrame(blocks)
    grouped = df.groupby(["mixer", "attention", "mlp", "norm"], sort=False).agg(
        indices=("index", list), params=("params", "first")
    )
    grouped = grouped.reset_index()
    grouped.insert(0, "blocks", grouped.pop("indices").map(_ranges))
    grouped = grouped.rename(columns={"params": "params/block"})
    return grouped


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    indices = sorted(indices)
    spans: list[tuple[int, int]] = []
    start = prev = indices[0]
    for cur in indices[1:]:
        if cur != prev + 1:
            spans.append((start, prev))
            start = cur
        prev = cur
    spans.append((start, prev))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


_EXAMINED = ("passed", "failed")  # stages whose result was actually computed


def what_is_new(report: dict[str, Any]) -> tuple[list[str], str]:
    """What no kind adapt knows covers, and the sentence to show when that list is empty.

    Only the operators stage compares components with the known kinds, and intake names modules
    it could not place; a run where neither examined the model says so instead of "nothing".
    """
    examined = {name: (stage(report, name) or {}).get("status") for name in ("intake", "operators")}
    items = [e if isinstance(e, str) else _describe(e) for e in summary(report, "operators").get("new", [])]
    unrecognised = summary(report, "intake").get("unrecognized", [])
    if unrecognised:
        items.append(f"modules whose role was not identified structurally: {', '.join(unrecognised)}")
    items = list(dict.fromkeys(items))
    if examined["operators"] not in _EXAMINED:
        items.append(f"not examined: the operators stage {examined['operators'] or 'absent'}, so components were "
                     "not compared with the kinds adapt knows")  # fmt: skip
        return items, ""
    return items, "Nothing: every component matches a kind adapt knows."


def known_features(report: dict[str, Any]) -> list[str]:
    """Architecture features intake found (GQA, sliding windows, MoE, ...): known kinds, worth stating, not new."""
    return [n for n in summary(report, "intake").get("novelties", []) if not n.startswith("unrecognised component")]


def errors_and_notes(report: dict[str, Any]) -> list[str]:
    """Every stage's error and notes, one line each: where a failed run's reason is."""
    lines = []
    for entry in report["stages"]:
        if entry.get("error"):
            lines.append(f"{entry['name']} {entry['status']}: {entry['error']}")
        elif entry.get("status") in ("blocked", "interrupted") and entry.get("verdict"):
            lines.append(f"{entry['name']} {entry['status']}: {entry['verdict']}")
        lines += [f"{entry['name']}: {note}" for note in (entry.get("summary") or {}).get("notes", [])]
    return lines


def _describe(entry: dict[str, Any]) -> str:
    head = entry.get("module") or entry.get("name") or entry.get("op") or "?"
    rest = ", ".join(f"{k}={_cell(v)}" for k, v in entry.items() if k not in ("module", "name", "op"))
    return f"{head}: {rest}" if rest else str(head)


NATIVE_PROVIDER, NATIVE_KERNEL = "torch-native", "aten ops as traced"  # the operators stage's words for "as is"


def operator_table(report: dict[str, Any]) -> pd.DataFrame:
    """One row per component; a native one without a provider (e.g. where rotary is applied) runs as traced."""
    rows = []
    for comp in summary(report, "operators").get("components", []):
        row = dict(comp)
        if row.get("status") == "native" and not row.get("provider"):
            row["provider"], row["kernel"] = NATIVE_PROVIDER, row.get("kernel") or NATIVE_KERNEL
        rows.append(row)
    return pd.DataFrame(rows, columns=["module", "kind", "provider", "kernel", "status"])


def coverage_table(report: dict[str, Any]) -> pd.DataFrame:
    ops = summary(report, "operators")
    counts = ops.get("status_counts", {})
    total = sum(counts.values())
    column = "share of components"
    rows = [
        {"status": k, "components": n, column: _share(n / total if total else None)} for k, n in sorted(counts.items())
    ]
    return pd.DataFrame(rows, columns=["status", "components", column])


# Each coverage figure says what it is a share of: components, traced ops and FLOPs differ.
_COVERAGE_LABELS = {
    "ops_total": "traced ops",
    "unmapped": "traced ops without a decision",
    "flops_total": "FLOPs traced",
    "flops_share_fused_or_native": "share of FLOPs on fused or native paths",
    "flops_share_recognised": "share of FLOPs inside components a probe confirmed as a known kind",
}


def coverage_facts(report: dict[str, Any]) -> pd.DataFrame:
    cov = _flatten(summary(report, "operators").get("coverage", {}))
    rows = [{"metric": _coverage_label(k), "value": _coverage_value(k, v)} for k, v in cov.items()]
    return pd.DataFrame(rows, columns=["metric", "value"])


def _coverage_label(key: str) -> str:
    if key.startswith("share_by_status."):
        return f"share of traced ops: {key.split('.', 1)[1]}"
    return _COVERAGE_LABELS.get(key, key)


def _coverage_value(key: str, value: Any) -> str:
    is_share = "share" in key and isinstance(value, (int, float)) and not isinstance(value, bool)
    return _share(float(value)) if is_share else _cell(value)


def plan_layout(report: dict[str, Any]) -> pd.DataFrame:
    best = summary(report, "plan").get("best") or {}
    rows = [{"field": k, "value": _cell(v)} for k, v in best.items() if not isinstance(v, dict) and k != "command"]
    return pd.DataFrame(rows, columns=["field", "value"])


PLAN_FILE = "plan.json"  # the run directory's copy of the planner's answer, written with the plan stage


def launch_command(report: dict[str, Any]) -> str | None:
    """The chosen plan's launch command as a user can paste it: ``python`` from their PATH (not this
    machine's interpreter path) and ``--plan`` pointing at the run directory's plan.json."""
    command = (summary(report, "plan").get("best") or {}).get("command")
    if not command:
        return None
    tokens = shlex.split(str(command))
    if tokens and os.path.isabs(tokens[0]) and "python" in os.path.basename(tokens[0]):
        tokens[0] = "python"
    out_dir = (report.get("options") or {}).get("out_dir")
    for i, token in enumerate(tokens[:-1]):
        if token == "--plan" and out_dir:
            tokens[i + 1] = str(Path(out_dir) / PLAN_FILE)
    return shlex.join(tokens)


def memory_breakdown(report: dict[str, Any]) -> pd.DataFrame:
    """The best plan's memory per GPU, in GiB, one row per component (nested dicts flattened)."""
    best = summary(report, "plan").get("best") or {}
    flat = _flatten(best.get("memory_breakdown") or {})
    rows = [{"component": k, "GiB": _gib(k, v)} for k, v in flat.items() if isinstance(v, (int, float))]
    return pd.DataFrame(rows, columns=["component", "GiB"])


def time_breakdown(report: dict[str, Any]) -> pd.DataFrame:
    """The chosen plan's predicted step time, in seconds, by component (compute, each collective, bubble)."""
    best = summary(report, "plan").get("best") or {}
    flat = _flatten(best.get("time_breakdown") or {})
    rows = [{"component": k, "seconds": float(v)} for k, v in flat.items() if isinstance(v, (int, float))]
    return pd.DataFrame(rows, columns=["component", "seconds"])


def _gib(key: str, value: float) -> float:
    # The planner reports GiB (keys ending _gib or a plain breakdown in GiB) or bytes (keys ending _bytes).
    return value / GIB if key.endswith("bytes") else float(value)


def ranked_plans(report: dict[str, Any]) -> pd.DataFrame:
    return pd.DataFrame(summary(report, "plan").get("plans", []))


_CALIBRATED = (
    ("step_time_s", "step time (s)"),
    ("tokens_per_s", "tokens/s"),
    ("tokens_per_s_per_gpu", "tokens/s per GPU"),
    ("mfu", "MFU"),
    ("memory_gib_per_gpu", "memory per GPU (GiB)"),
)


def plan_calibration(report: dict[str, Any]) -> pd.DataFrame:
    """The chosen plan before and after this machine's measurements, side by side (empty when not applied)."""
    replan = summary(report, "replan")
    before, after = replan.get("before"), replan.get("after")
    columns = ["figure", "before calibration", "after calibration", "change"]
    if not before or not after:
        return pd.DataFrame(columns=columns)
    old, new = _layout(before), _layout(after)
    rows = [["layout", old, new, "same" if old == new else "changed"]]
    rows += [[label, before.get(k), after.get(k), _relative(after.get(k), before.get(k))] for k, label in _CALIBRATED]
    return pd.DataFrame(rows, columns=columns)


def calibration_runs(report: dict[str, Any]) -> pd.DataFrame:
    """Each measured run: its rate and peak memory beside the model's prediction before and after calibration."""
    rows = [
        {
            "run": f"{r.get('gpus')} GPU, {_knobs(r.get('layout') or {})}, {r.get('global_batch')} x {r.get('seq_len')}",
            "measured tokens/s": r.get("measured_tokens_per_s"),
            "predicted before": r.get("before_tokens_per_s"),
            "predicted after": r.get("after_tokens_per_s"),
            "measured peak GiB": r.get("measured_peak_memory_gib"),
            "predicted GiB": r.get("predicted_memory_gib"),
        }
        for r in summary(report, "replan").get("measured_runs", [])
    ]
    return pd.DataFrame(rows)


def calibration_lines(report: dict[str, Any]) -> list[str]:
    """What the re-plan did with this machine's measurements, or why it left the plan as it was."""
    replan = summary(report, "replan")
    if not replan:
        return []
    if not replan.get("applied"):
        return [f"Not calibrated: {replan.get('reason')}."]
    return [f"The plan again, {replan.get('reason')}.", "What changed: " + "; ".join(replan.get("changes", [])) + "."]


def _layout(plan: dict[str, Any]) -> str:
    keys = ("tp", "pp", "dp", "cp", "ep", "zero", "recompute", "micro_batch", "vpp", "pp_schedule")
    return " ".join(f"{k}={plan.get(k)}" for k in keys)


def _knobs(layout: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in layout.items())


def _relative(new: Any, old: Any) -> str:
    ratio = _ratio(new, old)
    return "" if ratio is None else f"{ratio - 1:+.1%}"


def alignment_table(report: dict[str, Any]) -> pd.DataFrame:
    layers = summary(report, "alignment").get("layers", [])
    cols = ["name", "block", "component", "cosine", "rel_err", "max_abs", "err_ratio", "passed"]
    df = pd.DataFrame(layers, columns=cols)
    if not df.empty:
        df["block"] = df["block"].map(lambda b: "" if b is None or (isinstance(b, float) and math.isnan(b)) else int(b))
        df["component"] = df["component"].map(lambda c: c if isinstance(c, str) else "")
        # cosine lives in the last digits: 0.9999998 must not print as 1
        df["cosine"] = df["cosine"].map(lambda c: f"{c:.7f}" if isinstance(c, float) and math.isfinite(c) else "nan")
    return df


def alignment_extras(report: dict[str, Any]) -> list[str]:
    """One line each for the reference, the gradients and the loss-curve parity run."""
    align = summary(report, "alignment")
    lines = [f"Reference {align.get('reference_dtype')} on the CPU; inputs drawn with seed {align.get('seed')} at "
             f"{_cell(align.get('shapes'))}."]  # fmt: skip
    grads = align.get("gradients") or []
    if grads:
        worst = max(grads, key=lambda g: g["rel_err"] if isinstance(g.get("rel_err"), (int, float)) else math.inf)
        lines.append(
            f"Gradients: {sum(bool(g.get('passed')) for g in grads)}/{len(grads)} parameters within limits; "
            f"largest relative error {format_number(worst.get('rel_err'))} ({worst.get('name')})."
        )
    parity = align.get("parity")
    if parity:
        lines.append(
            f"Loss parity over {parity.get('steps')} training steps, adapted against unadapted: max relative "
            f"difference {format_number(parity.get('max_rel_diff'))} "
            f"(tolerance {format_number(parity.get('tolerance'))}): {'passed' if parity.get('passed') else 'FAILED'}."
        )
    return lines


def throughput_table(report: dict[str, Any]) -> pd.DataFrame:
    """Baseline against adapted, one row per measurement, with the speedup."""
    rows = summary(report, "throughput").get("rows", [])
    df = pd.DataFrame(rows)
    if {"baseline", "adapted"} <= set(df.columns) and "speedup" not in df.columns:
        df["speedup"] = [_ratio(a, b) for a, b in zip(df["adapted"], df["baseline"], strict=True)]
    return df


def throughput_caveats(report: dict[str, Any]) -> list[str]:
    """What the throughput figures can and cannot claim, stated beside them."""
    tp = summary(report, "throughput")
    lines = []
    if str(tp.get("device", "")).startswith("cpu"):
        shapes = tp.get("shapes") or {}
        lines.append(
            f"CPU figures at batch {shapes.get('batch_size')} x seq {shapes.get('seq_len')} are below the noise "
            "floor of a shared CPU: they show that both variants run, not which is faster (reruns of one model "
            "have ranged from 0.01x to 21x). Measure speed-ups on the target GPU."
        )
    spreads = [r for r in tp.get("rows", []) if isinstance(r.get("spread"), (int, float))]
    if spreads:
        lines.append("Spread over repeats (max/min): " + ", ".join(
            f"{r['metric']} {r['spread']:.2f}x" for r in spreads) + ".")  # fmt: skip
    elif tp:
        lines.append("The validator reported one median per variant, so the spread over repeats is unknown.")
    return lines


DECODE_COLUMNS = {  # decode target row key -> column title
    "batch": "batch",
    "eager_tokens_per_s": "HF eager tok/s",
    "static_compile_tokens_per_s": "HF static+compile tok/s",
    "adapted_tokens_per_s": "adapted tok/s",
    "vs_static_compile": "adapted / static+compile",
    "vs_eager": "adapted / eager",
    "static_compile_verdict": "vs static+compile target",
    "eager_verdict": "vs eager target",
    "verdict": "verdict",
}


def decode_targets_of(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The throughput stage's decode target rows (judged from its decode timings for reports that predate them)."""
    return recorded_decode_targets(summary(report, "throughput"))


def decode_table(report: dict[str, Any]) -> pd.DataFrame:
    """Decode tokens/s per batch on the serving paths (HF eager, HF static cache + compile, adapted), the ratios
    and the verdict against each target (the minimum ratio in the column's cell: ``passed (min 3x)``)."""
    rows = []
    for target in decode_targets_of(report):
        row = {title: target.get(key) for key, title in DECODE_COLUMNS.items()}
        for key in ("static_compile", "eager"):
            if target.get(f"{key}_verdict") is not None:
                row[DECODE_COLUMNS[f"{key}_verdict"]] = (
                    f"{target[f'{key}_verdict']} (min {_cell(float(target[f'min_vs_{key}']))}x)"
                )
        rows.append(row)
    return pd.DataFrame(rows, columns=list(DECODE_COLUMNS.values()))


def decode_caveats(report: dict[str, Any]) -> list[str]:
    """How the decode rows were measured, and each batch's reason (why inconclusive, by how much missed)."""
    tp = summary(report, "throughput")
    timings = tp.get("decode") or []
    if not timings:
        return []
    first = timings[0]
    lines = [f"Decode on the serving paths: prompt {first.get('prompt_len')}, {first.get('new_tokens')} new tokens, "
             "greedy; tokens/s count the tokens after the first, medians over repeats after a warm-up that "
             "compiles."]  # fmt: skip
    adapted = [t for t in timings if t.get("variant") == "adapted"]
    idle = [f"batch {t['batch']} {t['gpu_idle_share']:.0%}" for t in adapted if t.get("gpu_idle_share") is not None]
    if idle:
        lines.append("GPU idle share of the adapted decode: " + ", ".join(idle) + ".")
    spreads = [f"{t['variant']} batch {t['batch']} {t['decode_spread']:.2f}x" for t in timings
               if isinstance(t.get("decode_spread"), (int, float))]  # fmt: skip
    if spreads:
        lines.append("Decode spread over repeats (max/min): " + ", ".join(spreads) + ".")
    return lines + [t["reason"] for t in decode_targets_of(report) if t.get("reason")]


def _ratio(new: Any, old: Any) -> float | None:
    if isinstance(new, (int, float)) and isinstance(old, (int, float)) and old:
        return round(new / old, 3)
    return None


def soak_facts(report: dict[str, Any]) -> pd.DataFrame:
    soak = summary(report, "soak")
    keys = ("steps", "steps_planned", "resumed_from", "checkpoints", "first_loss", "last_loss", "loss_finite",
            "step_time_cv", "step_time_drift", "memory_slope_bytes_per_step", "leak")  # fmt: skip
    rows = [{"check": k, "value": _cell(soak.get(k))} for k in keys if k in soak]
    return pd.DataFrame(rows, columns=["check", "value"])


def soak_timeline(report: dict[str, Any]) -> pd.DataFrame:
    """One row per soak step: step, loss, grad_norm, step_time_s, allocated_bytes, reserved_bytes."""
    return pd.DataFrame(summary(report, "soak").get("timeline") or [])


# ---- cell formatting --------------------------------------------------------------------------


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _share(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    return str(value)


def format_number(value: Any) -> str:
    """How a number reads in a table cell: 4 significant digits, scientific for small errors."""
    if isinstance(value, bool) or value is None:
        return "" if value is None else ("yes" if value else "NO")
    if isinstance(value, float):
        if math.isnan(value):
            return ""  # pandas' marker for a value the stage did not report
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            return f"{value:.3e}"
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def to_markdown(df: pd.DataFrame) -> str:
    """A GitHub pipe table (pandas' to_markdown needs tabulate, which adapt does not depend on)."""
    if df.empty:
        return "_(none)_\n"
    header = [str(c) for c in df.columns]
    body = [
        [format_number(v).replace("|", "\\|").replace("\n", " ") for v in row] for row in df.itertuples(index=False)
    ]
    numeric = [pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c]) for c in df.columns]
    align = ["---:" if n else "---" for n in numeric]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"
