"""Why the device sat idle: each idle gap of a traced step, with what the host was doing while it lasted.

``step_profile.profile_steps`` measures the idle; this names its cause.  One more traced pass records host
operators and Python frames; for each gap the kernel that ended it is matched to its launch (the CUDA
runtime call with the same correlation id), and the host frames running between the device going idle and
that launch are the gap's source.  A gap whose kernel was launched before the device went idle waited on
the device itself (a stream dependency), not on the host.  Host synchronisations (``aten::item`` and the
like) are listed with their callers: each one drains the queue, so the host's next launch latency shows
as idle.  Recording frames slows the host, so gaps here run longer than untraced ones; the attribution,
not their size, is the reading.
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "python_function", "user_annotation"}
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero")
DEVICE_WAITS = ("Memcpy", "Synchronize")  # CUDA runtime calls that make the host wait for the device
# Frames that cover every gap and so explain none: the loop and the profiler's own.
UNINFORMATIVE = ("e2e_worker.py", "gap_sources.py", "threading.py", "<built-in method run_backward")


def _short(name: str, width: int = 90) -> str:
    """A frame name without its path prefix: ``site-packages/torch/_dynamo/eval_frame.py(..): _fn`` -> ``eval_frame.py(..): _fn``."""
    head, _, tail = name.partition("): ")
    path, _, line = head.rpartition("(")
    return f"{os.path.basename(path)}({line}): {tail}"[:width] if tail else name[:width]


def attribute(trace: dict[str, Any], steps: int, min_gap_us: float = 20.0, top: int = 12) -> dict[str, Any]:
    """Gaps of at least ``min_gap_us`` grouped by the innermost informative host frame that spans most of each."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in {"cuda_runtime", "cuda_driver"} and "correlation" in e.get("args", {})
    }
    # a frame spanning half of a gap lasts at least half the shortest gap: shorter ones can be dropped at once
    host = sorted(
        (e for e in events if e.get("cat") in HOST_CATEGORIES and e["dur"] >= min_gap_us / 2),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    by_source: dict[str, dict[str, float]] = {}
    device_bound = 0.0
    total = 0.0
    end = None
    for kernel in device:
        if end is not None and kernel["ts"] - end >= min_gap_us:
            gap = kernel["ts"] - end
            total += gap
            launch = launches.get(kernel.get("args", {}).get("correlation"))
            if launch is None or launch["ts"] < end:
                device_bound += gap
            else:
                source = _source(host, end, launch["ts"])
                entry = by_source.setdefault(source, {"ms": 0.0, "gaps": 0})
                entry["ms"] += gap / 1e3
                entry["gaps"] += 1
        end = max(end or 0.0, kernel["ts"] + kernel["dur"])
    # A read of a CPU tensor (an optimizer's step count) is no synchronisation: only calls that wait on the device
    # inside their span (a device-to-host copy, a stream or device synchronise) count.
    waits = sorted(
        e["ts"] for e in events if e.get("cat") == "cuda_runtime" and any(w in e["name"] for w in DEVICE_WAITS)
    )
    syncs: dict[str, int] = {}
    for e in events:
        if e.get("cat") in HOST_CATEGORIES and e["name"] in SYNC_OPS:
            first = bisect.bisect_left(waits, e["ts"])
            if first == len(waits) or waits[first] > e["ts"] + e["dur"]:
                continue
            caller = _source(host, e["ts"], e["ts"] + e["dur"], skip=e)
            syncs[f"{e['name']} in {caller}"] = syncs.get(f"{e['name']} in {caller}", 0) + 1
    ranked = sorted(by_source.items(), key=lambda kv: -kv[1]["ms"])[:top]
    return {
        "steps": steps,
        "min_gap_us": min_gap_us,
        "gap_ms_per_step": total / 1e3 / steps,
        "device_bound_ms_per_step": device_bound / 1e3 / steps,
        "host_sources": [
            {"source": s, "ms_per_step": v["ms"] / steps, "gaps_per_step": v["gaps"] / steps} for s, v in ranked
        ],
        "syncs_per_step": {k: n / steps for k, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:top]},
    }


def _source(host: list[dict[str, Any]], start: float, stop: float, skip: dict[str, Any] | None = None) -> str:
    """The innermost informative host frames covering at least half of [start, stop], inner first."""
    window = max(stop - start, 1e-3)
    covering = [
        e
        for e in host
        if e is not skip
        and e["ts"] <= start + 0.5 * window
        and e["ts"] + e["dur"] >= stop - 0.5 * window
        and min(e["ts"] + e["dur"], stop) - max(e["ts"], start) >= 0.5 * window
        and not any(mark in e["name"] for mark in UNINFORMATIVE)
    ]
    if not covering:
        return "no host frame spans it"
    covering.sort(key=lambda e: e["dur"])  # innermost (shortest) first
    return " < ".join(_short(e["name"]) for e in covering[:3])


def gap_sources(step: Callable[[int], Any], device: str, steps: int = 2) -> dict[str, Any]:
    """Trace ``steps`` calls of ``step`` with host frames and attribute the device's idle gaps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda":
        return {"steps": steps, "note": "gap attribution needs CUDA"}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            trace = json.load(handle)
    return attribute(trace, steps)


def gap_lines(model: str, variant: str, report: dict[str, Any]) -> list[str]:
    """Markdown bullets: idle per step by host source, and the synchronisations."""
    if "host_sources" not in report:
        return []
    lines = [
        f"- **{model} {variant}**: gaps >= {report['min_gap_us']:.0f} us {report['gap_ms_per_step']:.2f} ms per step "
        f"(traced with host frames), of which waiting on the device {report['device_bound_ms_per_step']:.2f}"
    ]
    lines += [
        f"  - {s['ms_per_step']:.2f} ms in {s['gaps_per_step']:.1f} gaps: {s['source']}"
        for s in report["host_sources"][:6]
    ]
    lines += [f"  - device sync x{n:.1f} per step: {k}" for k, n in list(report["syncs_per_step"].items())[:4]]
    return lines
