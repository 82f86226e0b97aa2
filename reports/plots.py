"""Figures for report.html, each returned as PNG bytes (None when the report has no data for it)."""

from __future__ import annotations

import io
import math
import textwrap
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from reports import tables  # noqa: E402

STATUS_COLOURS = {"fused": "#2e7d32", "native": "#66bb6a", "decomposed": "#fbc02d", "generated": "#1e88e5",
                  "unsupported": "#c62828"}  # fmt: skip


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _finite(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def alignment_errors(report: dict[str, Any]) -> bytes | None:
    """Relative L2 error per captured tensor, candidate against unadapted, failures in red."""
    df = tables.alignment_table(report)
    if df.empty:
        return None
    layers = tables.summary(report, "alignment").get("layers", [])
    cand = [_finite(layer.get("rel_err")) for layer in layers]
    base = [_finite(layer.get("baseline_rel_err")) for layer in layers]
    floor = 1e-12
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(layers)), 3.6))
    xs = range(len(layers))
    colours = ["#2e7d32" if layer.get("passed") else "#c62828" for layer in layers]
    ax.bar(xs, [max(c, floor) if c is not None else 0 for c in cand], color=colours, label="adapted")
    ax.plot(
        xs, [max(b, floor) if b is not None else math.nan for b in base], "k.--", lw=1, label="unadapted, same dtype"
    )
    for x, c in zip(xs, cand, strict=True):
        if c is None:
            ax.annotate("NaN/Inf", (x, floor), rotation=90, color="#c62828", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [layer.get("name", "") for layer in layers], rotation=75, fontsize=7, ha="right")
    reference = tables.summary(report, "alignment").get("reference_dtype") or "reference"
    ax.set_ylabel(f"relative L2 error vs {reference}")
    exact = all(c == 0 for c in cand if c is not None)
    ax.set_title(
        "Alignment error per block and component"
        + (f"\n(every error is exactly 0, drawn at {floor:g})" if exact else "")
    )
    ax.legend(fontsize=8)
    return _png(fig)


def operator_coverage(report: dict[str, Any]) -> bytes | None:
    df = tables.coverage_table(report)
    if df.empty:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 2.8))
    ax.barh(df["status"], df["components"], color=[STATUS_COLOURS.get(s, "#9e9e9e") for s in df["status"]])
    ax.set_xlabel("components")
    ax.set_title("Operator coverage by status")
    ax.invert_yaxis()
    return _png(fig)


def memory_breakdown(report: dict[str, Any]) -> bytes | None:
    df = tables.memory_breakdown(report)
    df = df[df["GiB"] > 0] if not df.empty else df
    if df.empty:
        return None
    fig, ax = plt.subplots(figsize=(6.0, 0.35 * len(df) + 1.2))
    ax.barh(df["component"], df["GiB"], color="#5c6bc0")
    ax.set_xlabel("GiB per GPU")
    ax.set_title("Memory per GPU of the chosen plan")
    ax.invert_yaxis()
    return _png(fig)


def throughput_figure(report: dict[str, Any]):
    """One panel per measurement; constrained layout keeps titles, unit labels and the heading apart."""
    df = tables.throughput_table(report)
    if df.empty or not {"metric", "baseline", "adapted"} <= set(df.columns):
        return None
    series = [c for c in ("baseline", "adapted", "compiled") if c in df.columns]
    fig, axes = plt.subplots(1, len(df), figsize=(2.6 * len(df) + 1, 3.4), squeeze=False, layout="constrained")
    for ax, (_, row) in zip(axes[0], df.iterrows(), strict=True):
        values = [_finite(row[s]) or 0.0 for s in series]
        ax.bar(series, values, color=["#9e9e9e", "#1e88e5", "#8e24aa"][: len(series)])
        ax.set_title(textwrap.fill(str(row["metric"]), 14), fontsize=9)
        ax.set_ylabel(str(row.get("unit", "")), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.tick_params(axis="x", labelrotation=30)
        ax.yaxis.get_offset_text().set_fontsize(7)
    fig.suptitle("Throughput: baseline against adapted")
    return fig


def throughput_bars(report: dict[str, Any]) -> bytes | None:
    fig = throughput_figure(report)
    return None if fig is None else _png(fig)


def soak_timeline(report: dict[str, Any]) -> bytes | None:
    df = tables.soak_timeline(report)
    if df.empty or "loss" not in df.columns:
        return None
    device = tables.summary(report, "soak").get("device", "")
    labels = {"allocated_bytes": "allocated" if str(device).startswith("cuda") else "process RSS",
              "reserved_bytes": "reserved"}  # fmt: skip
    fig, (ax_loss, ax_mem) = plt.subplots(2, 1, figsize=(6.5, 4.6), sharex=True)
    ax_loss.plot(df["step"], df["loss"], color="#1e88e5", marker=".")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("Soak: loss and memory per step")
    for col, label in labels.items():
        if col in df.columns and df[col].notna().any():
            ax_mem.plot(df["step"], df[col] / 2**20, label=label, marker=".")
    ax_mem.set_ylabel("MiB")
    ax_mem.set_xlabel("step")
    ax_mem.legend(fontsize=8)
    return _png(fig)


FIGURES = {
    "alignment": alignment_errors,
    "operators": operator_coverage,
    "plan": memory_breakdown,
    "throughput": throughput_bars,
    "soak": soak_timeline,
}
