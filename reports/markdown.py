"""report.md: the report a user reads first, rendered from report.json."""

from __future__ import annotations

from typing import Any

from reports import tables
from reports.agreement import agreement_lines, agreement_table
from reports.schema import stage, summary

STATUS_MARK = {"passed": "PASS", "failed": "FAIL", "error": "ERROR", "blocked": "BLOCKED", "skipped": "skipped",
               "interrupted": "INTERRUPTED", "pending": "not run", "incomplete": "INCOMPLETE"}  # fmt: skip


def render_markdown(report: dict[str, Any]) -> str:
    intake = summary(report, "intake")
    title = intake.get("model_class") or report["source"].get("text", "model")
    out = [
        f"# adapt report: {title}",
        "",
        f"**{STATUS_MARK.get(report['status'], report['status'])}** (exit code {report['exit_code']}) · "
        f"source `{report['source'].get('text')}` · fingerprint `{report['source'].get('fingerprint', '')[:12]}` · "
        f"adapt {report['adapt_version']} · {report['created_utc']}",
        "",
        "## Summary",
        "",
        tables.to_markdown(tables.stage_table(report)),
        shapes_line(report),
        "",
    ]
    out += _section_new(report)
    out += _section_model(report)
    out += _section_operators(report)
    out += _section_plan(report)
    out += _section_environment(report)
    out += _section_alignment(report)
    out += _section_throughput(report)
    out += _section_soak(report)
    out += _section_problems(report)
    return "\n".join(out).rstrip() + "\n"


def shapes_line(report: dict[str, Any]) -> str:
    """The shapes, steps and target the run used (the header of both report.md and report.html)."""
    o = report["options"]
    return (
        f"Validation ran on `{o.get('device')}` in `{o.get('dtype')}` at batch {o.get('batch_size')} × seq "
        f"{o.get('seq_len')} (throughput {o.get('bench_steps')} steps, soak {o.get('soak_steps')} steps, "
        f"checkpoint every {o.get('ckpt_every')}); the plan targets `{o.get('cluster')}` "
        f"at seq {o.get('plan_seq_len')}, "
        f"global batch {o.get('plan_global_batch')}, {o.get('precision')}."
    ) + _device_chosen(o)


def _device_chosen(options: dict[str, Any]) -> str:
    """Which of those values the validation device chose (``adapt run --help`` says how)."""
    chosen = options.get("device_chosen") or []
    if not chosen:
        return ""
    values = ", ".join(f"{name} {options.get(name)}" for name in chosen)
    return f" Defaults chosen by the device ({options.get('machine')}): {values}."


def _not_available(report: dict[str, Any], name: str) -> list[str]:
    entry = stage(report, name)
    status = entry["status"] if entry else "absent"
    reason = (entry or {}).get("verdict") or ""
    return [f"_No result: stage {status}{': ' + reason if reason else ''}._", ""]


def _section_new(report: dict[str, Any]) -> list[str]:
    items, empty = tables.what_is_new(report)
    lines = ["## What is new in this model", ""]
    lines += [f"- {item}" for item in items] if items else [empty]
    features = tables.known_features(report)
    if features:
        lines += ["", "Architecture features (kinds adapt knows): " + "; ".join(features) + "."]
    return lines + [""]


def _section_model(report: dict[str, Any]) -> list[str]:
    lines = ["## Model", ""]
    if not summary(report, "intake"):
        return lines + _not_available(report, "intake")
    return lines + [tables.to_markdown(tables.model_facts(report)), tables.to_markdown(tables.block_groups(report))]


def _section_operators(report: dict[str, Any]) -> list[str]:
    lines = ["## Operator mapping", ""]
    if not summary(report, "operators"):
        return lines + _not_available(report, "operators")
    return lines + [
        "Coverage by status:",
        "",
        tables.to_markdown(tables.coverage_table(report)),
        tables.to_markdown(tables.coverage_facts(report)),
        "Components:",
        "",
        tables.to_markdown(tables.operator_table(report)),
        *_agreement(report),
    ]


def _agreement(report: dict[str, Any]) -> list[str]:
    """Whether intake and the operators describe the model alike, and the facts where they do not."""
    table = agreement_table(report)
    lines = ["Intake against operators:", "", *[f"- {line}" for line in agreement_lines(report)], ""]
    return lines + ([tables.to_markdown(table)] if not table.empty else [])


def _section_plan(report: dict[str, Any]) -> list[str]:
    lines = ["## Parallel plan", ""]
    plan = summary(report, "plan")
    if not plan:
        return lines + _not_available(report, "plan")
    workload = plan.get("workload", {})
    lines += [f"Cluster `{plan.get('cluster')}`, workload {tables._cell(workload)}.", ""]
    if plan.get("binding_constraint"):
        lines += [f"Binding constraint: {plan['binding_constraint']}", ""]
    if not plan.get("best"):
        return lines + ["No layout fits.", ""]
    lines += [tables.to_markdown(tables.plan_layout(report)), "Memory per GPU of the chosen plan:", ""]
    lines += [tables.to_markdown(tables.memory_breakdown(report))]
    lines += ["Predicted step time of the chosen plan:", "", tables.to_markdown(tables.time_breakdown(report))]
    command = tables.launch_command(report)
    if command:
        lines += ["Launch (the plan is saved beside this report):", "", "```", command, "```", ""]
    lines += ["Ranked alternatives:", "", tables.to_markdown(tables.ranked_plans(report))]
    return lines + _section_calibrated_plan(report)


def _section_calibrated_plan(report: dict[str, Any]) -> list[str]:
    """The plan before and after the throughput stage's measurements of this machine (the replan stage)."""
    entry = stage(report, "replan")
    if entry is None or entry["status"] in ("skipped", "pending"):
        return []
    lines = ["### Before and after calibration", ""]
    if not summary(report, "replan"):
        return lines + _not_available(report, "replan")
    lines += [line for text in tables.calibration_lines(report) for line in (text, "")]
    comparison, runs = tables.plan_calibration(report), tables.calibration_runs(report)
    if not comparison.empty:
        lines += [tables.to_markdown(comparison)]
    if not runs.empty:
        lines += ["Measured on this machine, against the prediction:", "", tables.to_markdown(runs)]
    return lines


def _section_environment(report: dict[str, Any]) -> list[str]:
    lines = ["## Environment", ""]
    env = summary(report, "environment")
    if not env:
        return lines + _not_available(report, "environment")
    lines += [f"- {k}: {tables._cell(v)}" for k, v in (env.get("versions") or {}).items()]
    lines += [f"- problem: {p}" for p in env.get("problems", [])]
    lines += [f"- not checked here: {u}" for u in env.get("unchecked", [])]
    return lines + [""]


def _section_alignment(report: dict[str, Any]) -> list[str]:
    lines = ["## Alignment", ""]
    align = summary(report, "alignment")
    if not align:
        return lines + _not_available(report, "alignment")
    first = align.get("first_divergent")
    lines += [
        f"Candidate `{align.get('dtype')}` on `{align.get('device')}` "
        f"against a `{align.get('reference_dtype')}` reference; "
        f"err_ratio = candidate error / unadapted-model error in the same dtype.",
        "",
        f"**First divergent: `{first}`**" if first else "No divergent block.",
        "",
        *(f"{line}\n" for line in tables.alignment_extras(report)),
        tables.to_markdown(tables.alignment_table(report)),
    ]
    return lines


def _section_throughput(report: dict[str, Any]) -> list[str]:
    lines = ["## Throughput", ""]
    tp = summary(report, "throughput")
    if not tp:
        return lines + _not_available(report, "throughput")
    if tp.get("truncated"):
        lines += [f"Measured on a depth-truncated model: {tables._cell(tp['truncated'])}.", ""]
    for caveat in tables.throughput_caveats(report):
        lines += [caveat, ""]
    lines += [tables.to_markdown(tables.throughput_table(report))]
    decode = tables.decode_table(report)
    if not decode.empty:
        lines += [
            "### Decode",
            "",
            *(f"{line}\n" for line in tables.decode_caveats(report)),
            tables.to_markdown(decode),
        ]
    return lines


def _section_soak(report: dict[str, Any]) -> list[str]:
    lines = ["## Soak", ""]
    if not summary(report, "soak"):
        return lines + _not_available(report, "soak")
    entry = stage(report, "soak")
    lines += [f"Verdict: **{STATUS_MARK[entry['status']]}** — {entry.get('verdict', '')}", ""]
    return lines + [tables.to_markdown(tables.soak_facts(report))]


def _section_problems(report: dict[str, Any]) -> list[str]:
    lines = [f"- {line}" for line in tables.errors_and_notes(report)]
    return ["## Errors and notes", "", *lines, ""] if lines else []
