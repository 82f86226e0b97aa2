"""Pick between several qualifying kernels by timing them on the target device, with an on-disk cache.

Only used on CUDA: each candidate's replacement forward (plus backward when training) runs on a
copy of the real module at a representative token count.  A candidate without a replacement forward
is the module's own forward: the path the model already takes (an MoE block on transformers' grouped
GEMM, say) competes with the kernels.  When the plan compiles the model, every candidate is timed
inside ``torch.compile``: a hand kernel must beat what Inductor makes of the region it replaces, not
the eager module.

Each (candidate, kind, variant, dtype, tokens, context) is timed once per device and software
versions and kept in ``operators.timing_cache`` (``kernel_timings.json``), so a second run, or a
second model with the same shapes, times nothing.  Repetitions stop as soon as the spread is known.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch

from operators.recognition import Component
from operators.registry import KernelOption, Target
from operators.timing_cache import DiskCache, make_key

TOKENS = 8192
MIN_REPS, MAX_REPS = 5, 30
SPREAD = 0.03  # stop once the interquartile range is within 3% of the median
BUDGET_S = 1.0  # nor time one candidate for longer than this (after warm-up)


def _name(option: KernelOption) -> str:
    return f"{option.provider}:{option.kernel}"


def _key(option_name: str, comp: Component, target: Target, compiled: bool) -> str:
    variant = {k: v for k, v in comp.variant.items() if not k.endswith("evidence")}
    return make_key("cuda", option_name, comp.kind, variant, target.dtype, target.training, TOKENS, "compiled" if compiled else "eager")


def fastest(
    options: list[KernelOption], comp: Component, target: Target, module: torch.nn.Module | None = None, *, compiled: bool = False
) -> tuple[KernelOption, dict[str, float]]:
    """The fastest option and the timings (ms) that chose it; each option's timing comes from the cache when
    it is there.  Without a module to time, the first option in provider order and no timings."""
    if module is None or not torch.cuda.is_available() or "width" not in comp.variant:
        return options[0], {}
    cache = DiskCache("kernel_timings")
    by_name = {_name(o): o for o in options}
    timings = {name: cache.get(_key(name, comp, target, compiled)) for name in by_name}
    missing = [by_name[name] for name, ms in timings.items() if ms is None]
    if missing:
        for name, ms in measure(missing, comp, target, module, compiled=compiled).items():
            timings[name] = ms
            cache.put(_key(name, comp, target, compiled), ms)
    winner = min(timings, key=timings.get)
    return by_name[winner], timings


def measure(options: list[KernelOption], comp: Component, target: Target, module: torch.nn.Module, *, compiled: bool = False) -> dict[str, float]:
    """Median ms of each option's forward (+ backward when training) on a CUDA copy of ``module``."""
    dtype = getattr(torch, target.dtype)
    timings = {}
    for opt in options:
        mod = copy.deepcopy(module).to("cuda", dtype)
        fwd = opt.make_forward(mod, comp) if opt.make_forward else mod.forward
        if compiled:
            fwd = torch.compile(fwd, fullgraph=False, dynamic=False)
        x = torch.randn(1, TOKENS, comp.variant["width"], device="cuda", dtype=dtype, requires_grad=target.training)
        timings[_name(opt)] = time_ms(lambda fwd=fwd, x=x: _step(fwd, x, target.training), cuda_timer)
        del mod, fwd
    return timings


def _step(fwd, x, training: bool) -> None:
    out = fwd(x)
    out = out[0] if isinstance(out, tuple) else out  # MoE blocks may return (hidden, router logits)
    if training:
        out.float().sum().backward()


def cuda_timer(fn: Callable[[], None]) -> float:
    """Milliseconds of one call of ``fn`` by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def time_ms(fn: Callable[[], None], timer: Callable[[Callable[[], None]], float], warmup: int = 2) -> float:
    """Median of ``timer(fn)`` over as few repetitions as pin it: at least ``MIN_REPS``, then until the
    interquartile range is within ``SPREAD`` of the median, ``MAX_REPS`` are taken or ``BUDGET_S`` is spent."""
    for _ in range(warmup):
        timer(fn)
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < MAX_REPS:
        times.append(timer(fn))
        if len(times) >= MIN_REPS and (settled(times) or time.perf_counter() - started > BUDGET_S):
            break
    return statistics.median(times)


def settled(times: list[float]) -> bool:
    """The middle half of the samples lies within ``SPREAD`` of their median."""
    q1, median, q3 = statistics.quantiles(times, n=4)
    return median > 0 and (q3 - q1) <= SPREAD * median
