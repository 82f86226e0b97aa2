"""Pick between several qualifying kernels by timing them on the target device, with an on-disk cache.

Only used on CUDA: each candidate's replacement forward (plus backward when training) runs on a
copy of the real module at a representative token count; the median of CUDA-event timings
decides.  A candidate without a replacement forward is the module's own forward: the path the model
already takes (an MoE block on transformers' grouped GEMM, say) competes with the kernels.  Results
are cached per (device name, kind, variant, dtype, tokens) in ``$ADAPT_CACHE/kernel_bench.json``
(default ``~/.cache/adapt``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import torch

from operators.recognition import Component
from operators.registry import KernelOption, Target

TOKENS = 8192


def _cache_path() -> Path:
    return Path(os.environ.get("ADAPT_CACHE", Path.home() / ".cache" / "adapt")) / "kernel_bench.json"


def _key(comp: Component, target: Target) -> str:
    variant = {k: v for k, v in comp.variant.items() if not k.endswith("evidence")}
    payload = json.dumps([torch.cuda.get_device_name(), comp.kind, variant, target.dtype, target.training, TOKENS], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def fastest(options: list[KernelOption], comp: Component, target: Target, module: torch.nn.Module | None = None) -> tuple[KernelOption, dict[str, float]]:
    """The fastest option and the timings (ms) that chose it (cached); without a module to time, the
    first option in provider order and no timings."""
    if module is None or not torch.cuda.is_available() or "width" not in comp.variant:
        return options[0], {}
    path = _cache_path()
    cache = json.loads(path.read_text()) if path.is_file() else {}
    key = _key(comp, target)
    by_name = {_name(o): o for o in options}
    if key in cache and set(cache[key]["ms"]) == set(by_name):
        return by_name[cache[key]["winner"]], cache[key]["ms"]
    timings = measure(options, comp, target, module)
    winner = min(timings, key=timings.get)
    cache[key] = {"winner": winner, "ms": timings}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache, indent=1))
    return by_name[winner], timings


def _name(option: KernelOption) -> str:
    return f"{option.provider}:{option.kernel}"


def measure(options: list[KernelOption], comp: Component, target: Target, module: torch.nn.Module) -> dict[str, float]:
    """Median ms of each option's forward (+ backward when training) on a CUDA copy of ``module``."""
    dtype = getattr(torch, target.dtype)
    timings = {}
    for opt in options:
        mod = copy.deepcopy(module).to("cuda", dtype)
        fwd = opt.make_forward(mod, comp) if opt.make_forward else mod.forward
        x = torch.randn(1, TOKENS, comp.variant["width"], device="cuda", dtype=dtype, requires_grad=target.training)
        timings[_name(opt)] = _time(lambda fwd=fwd, x=x: _step(fwd, x, target.training))
    return timings


def _step(fwd, x, training: bool) -> None:
    out = fwd(x)
    out = out[0] if isinstance(out, tuple) else out  # MoE blocks may return (hidden, router logits)
    if training:
        out.float().sum().backward()


def _time(fn, warmup: int = 3, reps: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
