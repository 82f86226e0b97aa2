"""What is allocated at a training step's peak, and where it was allocated: the evidence behind a peak-memory figure.

``live_at_peak(step)`` records the CUDA caching allocator's history over one call of ``step`` (torch's own
``_record_memory_history``), replays its alloc/free events to the moment the allocated total was highest and
groups the blocks live then by the innermost frame that says who asked for them: a model file, adapt, Liger,
Inductor's generated code.  Blocks allocated before the step (weights, gradients, optimizer state) are one line.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

# frames that explain nothing on their own (torch's Python internals, this file); Inductor's generated graphs
# (``.../torchinductor_<user>/xx/cxyz.py``) are kept: they are where a compiled block allocates.
_PLUMBING = re.compile(r"/torch/(?!_inductor/)|/torch/_inductor/(?!.*torchinductor)|memory_peak\.py|/contextlib\.py")
_GENERATED = re.compile(r"torchinductor_[^/]+/")


def origin(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch's plumbing (frames come innermost first), as ``file:line function``."""
    for frame in frames:
        name = frame.get("filename", "")
        if _GENERATED.search(name):
            return f"inductor graph {name.rsplit('/', 1)[-1]} {frame.get('name', '')}"
        if name and not _PLUMBING.search(name) and not name.startswith("<"):
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{frame.get('line', '?')} {frame.get('name', '')}"
    return "no Python frame (C++ or the backward engine)"


def replay_peak(events: list[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]], int]:
    """(bytes above the start at the highest point, the blocks allocated in the trace live then, bytes freed by then
    that were allocated before the trace).  Events are the allocator's, in order."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = freed_before = peak_freed_before = 0
    peak_live: dict[int, dict[str, Any]] = {}
    for event in events:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, peak_live, peak_freed_before = total, dict(live), freed_before
        elif action == "free_completed":
            if live.pop(event["addr"], None) is None:
                freed_before += event["size"]
            total -= event["size"]
    return peak, peak_live, peak_freed_before


def live_at_peak(step: Callable[[], Any], top: int = 15) -> dict[str, Any]:
    """Run ``step`` once under the allocator's history; the peak and its live blocks grouped by origin (GiB)."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][torch.cuda.current_device()]
    peak, blocks, freed_before = replay_peak(events)
    groups: dict[str, int] = defaultdict(int)
    for block in blocks.values():
        groups[origin(block.get("frames", []))] += block["size"]
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    gib = 2**30
    return {
        "before_step_gib": before / gib,
        "peak_gib": (before + peak) / gib,
        "allocated_before_and_live_at_peak_gib": (before - freed_before) / gib,
        "trace_events": len(events),
        "by_origin_gib": [[name, size / gib] for name, size in ranked[:top]],
        "other_origins_gib": sum(size for _, size in ranked[top:]) / gib,
    }


def memory_lines(report: dict[str, Any]) -> list[str]:
    """The e2e report's section: per variant, the peak and its largest origins."""
    lines: list[str] = []
    for model, entry in report["models"].items():
        for variant, result in entry.get("variants", {}).items():
            mem = result.get("memory_at_peak")
            if not mem:
                continue
            if not lines:
                lines = ["", "## Allocated at one step's peak, by origin (GiB)", ""]
            top = "; ".join(f"{name} {size:.2f}" for name, size in mem["by_origin_gib"][:8])
            lines.append(
                f"- **{model} {variant}**: peak {mem['peak_gib']:.2f}, of which allocated before the step and live "
                f"{mem['allocated_before_and_live_at_peak_gib']:.2f}; {top}; other origins {mem['other_origins_gib']:.2f}"
            )
    return lines
