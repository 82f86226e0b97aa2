"""Where one training step's time goes on the GPU: kernel time by kind, idle gaps, and the host's share.

The end-to-end benchmark calls ``profile_steps`` after its timed steps.  Only device activity is traced
(no CPU operator events), so the profiler adds little host work and the idle it reports is the step's
own: the gaps where the GPU waited for the host (launch overhead, a synchronisation) rather than
an artefact of recording every Python-level operator.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

# First match wins: a cuBLAS/CUTLASS/Triton-template GEMM before the generic Triton rule, and so on.
KERNEL_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|triton_tem|grouped_mm|_mm_kernel|splitk", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|cudnn|sdpa|mha_|_attn", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|foreach", re.I)),
    ("loss", re.compile(r"_ce_chunk|cross_entropy|log_softmax|nll_loss|liger.*(ce|cross)", re.I)),
    # A Triton kernel is named by its Python function alone (Inductor's ``triton_*``, ours ``_rms_norm_fwd``); ATen,
    # NCCL and library kernels carry C++ signatures, namespaces or spaces.
    ("triton (Inductor or hand-written)", re.compile(r"^triton_|^\w+$")),
    ("copies and fills", re.compile(r"memcpy|memset|copy|fill", re.I)),
)
OTHER = "other ATen"


def kernel_kind(name: str) -> str:
    for kind, pattern in KERNEL_KINDS:
        if pattern.search(name):
            return kind
    return OTHER


def _device_kernels(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device-side event, sorted by start."""
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)
    )


def summarise(kernels: list[tuple[float, float, str]], wall_us: float, steps: int, top_gaps: int = 5) -> dict[str, Any]:
    """Busy time (the union of kernel intervals), idle gaps with their neighbours, and time by kernel kind."""
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for start, end, name in kernels:
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + end - start
        by_name[name] = by_name.get(name, 0.0) + end - start
    busy, gaps, run_start, run_end, last_name = 0.0, [], None, None, ""
    for start, end, name in kernels:
        if run_end is None or start > run_end:
            if run_end is not None:
                busy += run_end - run_start
                gaps.append((start - run_end, last_name, name))
            run_start, run_end = start, end
        elif end <= run_end:
            continue
        else:
            run_end = end
        last_name = name
    if run_end is not None:
        busy += run_end - run_start
    per_step = 1e3 * steps  # us over `steps` steps -> ms per step
    gaps.sort(key=lambda g: -g[0])
    return {
        "steps": steps,
        "wall_ms_per_step": wall_us / per_step,
        "device_busy_ms_per_step": busy / per_step,
        "device_idle_share": 1 - busy / wall_us if wall_us else None,
        "kernels_per_step": len(kernels) / steps,
        "by_kind_ms_per_step": {k: v / per_step for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": n[:90], "ms_per_step": t / per_step} for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
        ],
        # every kernel's time, so that a later reading can group them differently
        "by_name_ms_per_step": {n[:120]: t / per_step for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])},
        "largest_gaps": [{"ms": g / 1e3, "after": a[:60], "before": b[:60]} for g, a, b in gaps[:top_gaps] if g > 0],
        "gaps_over_50us_ms_per_step": sum(g for g, _, _ in gaps if g > 50) / per_step,
    }


def profile_steps(step: Callable[[int], Any], device: str, steps: int = 3) -> dict[str, Any]:
    """Trace ``steps`` calls of ``step`` (each ending in a host synchronisation) and summarise them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda":
        return {"steps": steps, "note": "device profile needs CUDA"}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    return summarise(_device_kernels(prof), wall_us, steps)


# Leaf GEMM operators: their device time is the GEMM kernels they launch (aten::linear and matmul only route to them).
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::_scaled_mm")


def gemm_time_by_shape(step: Callable[[int], Any], device: str, steps: int = 2, top: int = 12) -> list[dict[str, Any]]:
    """GEMM device time per step by (operator, input shapes), from one more traced pass that records host-side
    operators and their shapes.  That adds host work, so it is a separate pass from ``profile_steps``; a GEMM's
    own device time does not change with it.  Graphs replayed as CUDA graphs launch no operators and are absent."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda":
        return []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    rows = [
        {
            "op": e.key,
            "shapes": str(e.input_shapes)[:160],
            "calls_per_step": e.count / steps,
            "ms_per_step": e.device_time_total / 1e3 / steps,
        }
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key in GEMM_OPS and e.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:top]


def profile_lines(report: dict[str, Any]) -> list[str]:
    """Per variant: device busy against the step's wall time, the host's own time, GPU time by kernel kind,
    the largest idle gaps and the top kernels."""
    profiles = [(m, n, v) for m, e in report["models"].items() for n, v in e["variants"].items() if v.get("profile")]
    if not profiles:
        return []
    lines = [
        "",
        "## Profiles (device activity only, 3 steps, ms per step)",
        "",
        "Host = the host's time to issue one step before it waits on the device (from the timed steps). "
        "Gaps = device idle between kernels, the largest ones with the kernels on either side.",
        "",
    ]
    for model, name, v in profiles:
        prof = v["profile"]
        if "wall_ms_per_step" not in prof:
            continue
        kinds = ", ".join(f"{k} {t:.1f}" for k, t in prof["by_kind_ms_per_step"].items())
        gaps = "; ".join(f"{g['ms']:.2f} ms after {g['after']} before {g['before']}" for g in prof["largest_gaps"][:3])
        top = "; ".join(f"{t['name']} {t['ms_per_step']:.1f}" for t in prof["top_kernels"][:5])
        host = v.get("host_issue_s_mean")
        host_text = f"{1e3 * host:.1f}" if host is not None else "–"
        gemms = "; ".join(
            f"{g['op'][6:]} {g['shapes']} x{g['calls_per_step']:.0f} {g['ms_per_step']:.1f}"
            for g in v.get("gemm_by_shape", [])[:6]
        )
        lines += [
            f"- **{model} {name}**: wall {prof['wall_ms_per_step']:.1f}, device busy "
            f"{prof['device_busy_ms_per_step']:.1f} (idle {prof['device_idle_share']:.1%}, gaps over 50 us "
            f"{prof['gaps_over_50us_ms_per_step']:.1f}), host {host_text}, {prof['kernels_per_step']:.0f} kernels",
            f"  - by kind: {kinds}",
            f"  - largest gaps: {gaps or 'none'}",
            f"  - top kernels: {top}",
        ]
        if gemms:
            lines.append(f"  - GEMMs by shape: {gemms}")
        if v.get("cudagraph_skips"):
            lines.append(f"  - graphs that ran without CUDA-graph replay: {v['cudagraph_skips']}")
    return lines
