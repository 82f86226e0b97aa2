"""What the report shows of the throughput stage: the rates of each variant side by side, the measured verdict and the
parts it is judged on (``adapt.core.stage_verdicts.throughput_checks``).  Kept beside ``validators.throughput`` so
that module stays about measuring."""

from __future__ import annotations

from typing import Any

from adapt.core.stage_verdicts import StageSummary, SummaryContext, num, throughput_checks

# (metric key in a variant, label, unit, scale, higher is better)
METRICS = (
    ("train_tokens_per_s", "train step", "tokens/s", 1.0, True),
    ("prefill_tokens_per_s", "prefill", "tokens/s", 1.0, True),
    ("decode_tokens_per_s", "decode", "tokens/s", 1.0, True),
    ("mfu", "MFU", "fraction", 1.0, True),
    ("train_step_s", "train step time", "s", 1.0, False),
    ("peak_memory_bytes", "peak memory", "MiB", 1.0 / 2**20, False),
)


def _rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per metric any variant measured: baseline (eager), adapted and compiled, and adapted/eager for rates."""
    variants = {v["name"]: v for v in report.get("variants", [])}
    named = (
        ("baseline", variants.get("eager")),
        ("adapted", variants.get("adapted")),
        ("compiled", variants.get("compiled")),
    )
    rows = []
    for key, label, unit, scale, higher_better in METRICS:
        values = {
            name: (num(v.get(key)) * scale if num(v.get(key)) is not None else None)
            for name, v in named
            if v is not None
        }
        if all(value is None for value in values.values()):
            continue
        row = {"metric": label, "unit": unit, **values}
        base, new = values.get("baseline"), values.get("adapted")
        if higher_better and base and new is not None:
            row["speedup"] = new / base
        rows.append(row)
    return rows


def throughput_summary(report: dict[str, Any], finite: bool, context: SummaryContext) -> StageSummary:
    """``report`` is ``ThroughputReport.to_dict()`` as JSON holds it; ``finite``: every variant measured a rate and a
    finite loss."""
    rows = _rows(report)
    data = {
        "device": report.get("device", context.device),
        "device_name": report.get("device_name"),
        "dtype": report.get("dtype", context.dtype),
        "rows": rows,
        "truncated": report.get("truncated"),
        "layers_measured": report.get("layers_measured"),
        "peak_flops_basis": report.get("peak_flops_basis"),
        "calibration": report.get("calibration"),
        "shapes": {
            "seq_len": report.get("seq_len", context.seq_len),
            "batch_size": report.get("batch", context.batch_size),
        },
        "verdict": report.get("verdict"),
        "reasons": report.get("reasons", []),
        "decode": report.get("decode", []),
        "decode_targets": report.get("decode_targets", []),
        "vs_best_baseline": report.get("speedup_vs_best_baseline") or {},
        "optimizers": {v["name"]: v["optimizer"] for v in report.get("variants", []) if v.get("optimizer")},
        "finite": finite,
    }
    speedups = [
        f"{r['metric']} x{r['speedup']:.2f}" for r in rows if r.get("speedup") is not None and r["unit"] == "tokens/s"
    ]
    line = f"adapted/eager on {data['device_name'] or data['device']}: " + (
        ", ".join(speedups) or "no comparable rates"
    )
    if data["verdict"] in ("failed", "inconclusive") and data["reasons"]:
        line = f"{data['verdict']} ({data['reasons'][0]}); {line}"  # the measured verdict and why, first
    elif data["verdict"] == "passed" and data["reasons"]:
        line = f"{data['reasons'][0]}; {line}"
    return StageSummary(line, data, throughput_checks(data, context.section("throughput")))
