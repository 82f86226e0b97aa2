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
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from operators.recognition.component import Component
from operators.recognition.variants import AttentionVariant
from operators.registry import KernelOption, Target
from operators.timing_cache import DiskCache, make_key

log = logging.getLogger(__name__)

TOKENS = 8192
MIN_REPS, MAX_REPS = 5, 30
SPREAD = 0.03  # stop once the interquartile range is within 3% of the median
BUDGET_S = 1.0  # nor time one candidate for longer than this (after warm-up)
MAX_SLEEP_MS = 50.0  # the longest the GPU is held busy before one timed call
TIMING_METHOD = "device-time-covered"  # in every cache key: timings taken another way are not reused (see DeviceTimer)


def _name(option: KernelOption) -> str:
    return f"{option.provider}:{option.kernel}"


def _key(option_name: str, comp: Component, target: Target, compiled: bool) -> str:
    """What a timing depends on.  Module paths in the variant (an MoE's router and expert banks) are keyed
    relative to the component, so the same block at every depth, or in another model, shares one timing."""
    variant = {k: _relative(v, comp.module) for k, v in comp.variant.to_dict().items() if not k.endswith("evidence")}
    return make_key(
        "cuda",
        option_name,
        comp.kind,
        variant,
        target.dtype,
        target.training,
        TOKENS,
        "compiled" if compiled else "eager",
        TIMING_METHOD,
    )


def _relative(value: Any, base: str) -> Any:
    """``value`` with every module path inside ``base`` written from ``base`` (``.gate`` for ``base.gate``)."""
    if isinstance(value, str) and base and value.startswith(base + "."):
        return value[len(base) :]
    if isinstance(value, dict):
        return {k: _relative(v, base) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_relative(v, base) for v in value]
    return value


def fastest(
    options: list[KernelOption],
    comp: Component,
    target: Target,
    module: torch.nn.Module | None = None,
    *,
    compiled: bool = False,
) -> tuple[KernelOption, dict[str, float]]:
    """The fastest option and the timings (ms) that chose it; each option's timing comes from the cache when
    it is there.  Without a module to time, the first option in provider order and no timings."""
    if module is None or not torch.cuda.is_available() or getattr(comp.variant, "width", None) is None:
        return options[0], {}
    cache = DiskCache("kernel_timings")
    by_name = {_name(o): o for o in options}
    timings = {name: cache.get(_key(name, comp, target, compiled)) for name in by_name}
    missing = [by_name[name] for name, ms in timings.items() if ms is None]
    if missing:
        for name, ms in measure(missing, comp, target, module, compiled=compiled).items():
            timings[name] = ms
            cache.put(_key(name, comp, target, compiled), ms)
    timings = {name: ms for name, ms in timings.items() if ms is not None}  # a candidate that could not run is out
    if not timings:
        raise RuntimeError(f"no candidate for {comp.module} ({comp.kind}) could run on {target.device}")
    return by_name[winner_of(timings, {name for name, o in by_name.items() if o.keeps_less})], timings


# Timings within this share of the fastest count as the same speed: a kernel that keeps less for the backward may
# cost a component up to 2% (on the H200 the fused unit + down projection trailed by 0.9%, e2e-h200.md) for memory
# a step can spend on batch or on skipping recomputation.
SAME_SPEED = 0.02


def winner_of(timings: dict[str, float], keeps_less: set[str]) -> str:
    """The fastest option, or, among those within ``SAME_SPEED`` of it, one that keeps fewer activations for the
    backward: at equal speed, memory that a step does not hold is batch or recomputation it can spend."""
    fastest_name = min(timings, key=timings.get)
    frugal = [n for n in keeps_less if n in timings and timings[n] <= timings[fastest_name] * (1 + SAME_SPEED)]
    return min(frugal, key=timings.get) if frugal else fastest_name


def measure(
    options: list[KernelOption], comp: Component, target: Target, module: torch.nn.Module, *, compiled: bool = False
) -> dict[str, float]:
    """Median ms of each option's forward (+ backward when training) on a CUDA copy of ``module``.

    ``compiled``: the options will run inside compiled blocks, so each path Inductor rewrites is timed as
    Inductor compiles it; a hand kernel is timed as it is (``KernelOption.inductor_rewrites``), which is what runs there
    too, without the seconds a compile per option would add to the operators stage.

    Candidates are timed before any check of their numerics (``KernelOption.verify`` runs on the winner), so
    one that cannot run here is left out of the result, with a warning, instead of failing the plan."""
    dtype = getattr(torch, target.dtype)
    timings = {}
    for opt in options:
        began = time.perf_counter()
        mod = copy.deepcopy(module).to("cuda", dtype)
        rows = getattr(comp.variant, "rows_per_token", 1)  # a per-head norm sees heads rows per token
        shape = (1, TOKENS, rows, comp.variant.width) if rows > 1 else (1, TOKENS, comp.variant.width)
        x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=target.training)
        try:
            fwd = opt.make_forward(mod, comp) if opt.make_forward else mod.forward
            if comp.kind == "routed_experts":  # called with its block's routing: balanced, as a trained router keeps it
                fwd = _with_routing(fwd, comp.variant, target.training)
                x = x.view(TOKENS, comp.variant.width).detach().requires_grad_(target.training)
            if compiled and opt.inductor_rewrites:
                fwd = torch.compile(fwd, fullgraph=False, dynamic=False)
            timings[_name(opt)] = time_ms(lambda fwd=fwd, x=x: _step(fwd, x, target.training), DeviceTimer())
        except Exception as err:  # a kernel that cannot run here is not a candidate; the others still are
            log.warning("%s could not run for %s: %s: %s", _name(opt), comp.module, type(err).__name__, err)
        del mod
        log.debug("timed %s for %s: %.2f s (compile included)", _name(opt), comp.kind, time.perf_counter() - began)
    return timings


def _with_routing(fwd, variant, training: bool):
    """``fwd(x, index, weights)`` as ``fwd(x)``: each token's ``top_k`` distinct experts drawn uniformly."""
    experts, top_k = int(variant.num_experts), int(variant.top_k or 1)
    index = torch.rand(TOKENS, experts, device="cuda").topk(top_k, dim=-1).indices
    weights = torch.rand(TOKENS, top_k, device="cuda", requires_grad=training)
    return lambda x: fwd(x, index, weights)


def _step(fwd, x, training: bool) -> None:
    out = fwd(x)
    out = out[0] if isinstance(out, tuple) else out  # MoE blocks may return (hidden, router logits)
    if training:
        out.float().sum().backward()


class DeviceTimer:
    """Milliseconds of device time of one call of ``fn``, by CUDA events around it.

    Before the start event the GPU is kept busy (``torch.cuda._sleep``) for longer than the host takes to
    enqueue ``fn``'s kernels, so the events time the kernels back to back.  Without it, a candidate whose
    kernels run faster than the host launches them is timed by its host overhead: small modules then rank
    by Python and dispatch noise, not by what they cost inside a compiled, GPU-bound training step.  Whether
    the sleep outlasted the enqueue is read from the GPU itself (the start event still pending when the host
    is done), not from the sleep's planned length: a sleep's cycles last less once the clock boosts past the
    rate they were calibrated at.  A call the sleep did not cover is timed again with a longer one.
    """

    def __init__(self, device: Any = None, tries: int = 3) -> None:
        self.device = device if device is not None else torch.cuda
        self.host_ms = 0.5  # the host's enqueue time of the last call: the next sleep covers twice that
        self.sleep_scale = 1.0  # grows when a sleep planned long enough ran short (a clock faster than calibrated)
        self.tries = tries
        self._cycles_per_ms: float | None = None

    def cycles_per_ms(self) -> float:
        """GPU sleep cycles per millisecond: the highest rate of three readings (the clock ramps up under load, and a
        rate read too low only shortens the sleeps, which the coverage check then catches)."""
        if self._cycles_per_ms is None:
            cycles = 1_000_000
            readings = [self._events(lambda: self.device._sleep(cycles))[0] for _ in range(3)]
            self._cycles_per_ms = cycles / max(min(readings), 1e-3)
        return self._cycles_per_ms

    def __call__(self, fn: Callable[[], None]) -> float:
        ms = 0.0
        for _ in range(self.tries):
            # a compiling first call must not set a long sleep: MAX_SLEEP_MS bounds it
            slept_ms = min(2.0 * self.host_ms * self.sleep_scale, MAX_SLEEP_MS)
            self.device.synchronize()
            self.device._sleep(int(slept_ms * self.cycles_per_ms()))
            ms, covered = self._events(fn, hold=True)
            if covered:
                break
            if self.host_ms <= slept_ms:  # the GPU left the sleep before the planned time
                self.sleep_scale *= 4.0
        return ms

    def _events(self, fn: Callable[[], None], hold: bool = False) -> tuple[float, bool]:
        """(ms between the events around ``fn``, whether the GPU was still held when the host had enqueued it)."""
        start, end = self.device.Event(enable_timing=True), self.device.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        fn()
        covered = True
        if hold:
            self.host_ms = (time.perf_counter() - began) * 1e3
            covered = not start.query()
        end.record()
        self.device.synchronize()
        return start.elapsed_time(end), covered


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


# SDPA's backends by measurement: the name the plan records -> ``torch.nn.attention.SDPBackend`` member.
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
ATTENTION_SEQ = 2048
DEFAULT_DISPATCH = "default"


def attention_backend(variant: AttentionVariant, target: Target) -> tuple[str | None, dict[str, float], str]:
    """(SDPA backend to pin, or None to leave PyTorch's own dispatch; ms per backend; why).

    Each backend runs causal SDPA (forward, plus backward when training) at the component's heads and
    head size over ``ATTENTION_SEQ`` tokens, beside the default dispatch; a backend is pinned only when
    it beats the default by more than the timing noise.  A backend that refuses the shape is left out.
    """
    if target.device != "cuda" or not torch.cuda.is_available():
        return (
            None,
            {},
            f"{target.device}: the SDPA backend is chosen by measurement on CUDA only; PyTorch's dispatch decides here",
        )
    if variant.softcap or variant.sinks:
        return None, {}, "score modification (softcap/sinks): FlexAttention, not an SDPA backend"
    if variant.window or not variant.causal or variant.mla:
        return None, {}, "needs a mask or unequal head sizes: PyTorch's dispatch decides"
    cache = DiskCache("attention_timings")
    shape = [variant.num_heads, variant.head_dim, target.dtype, target.training, ATTENTION_SEQ]
    timings: dict[str, float] = {}
    for name in (DEFAULT_DISPATCH, *SDPA_BACKENDS):
        key = make_key("cuda", "sdpa", name, shape, TIMING_METHOD)
        ms = cache.get(key)
        if ms is None:
            ms = _time_sdpa(
                name, int(variant.num_heads), int(variant.head_dim), getattr(torch, target.dtype), target.training
            )
            cache.put(key, ms)
        if ms >= 0:  # -1: this backend cannot run the shape
            timings[name] = ms
    if DEFAULT_DISPATCH not in timings:
        return None, timings, "the default dispatch could not be timed"
    best = min(timings, key=timings.get)
    if best == DEFAULT_DISPATCH or timings[DEFAULT_DISPATCH] <= timings[best] * (1 + SPREAD):
        return None, timings, "no backend beats PyTorch's own dispatch beyond timing noise"
    return best, timings, f"{best} beats the default dispatch x{timings[DEFAULT_DISPATCH] / timings[best]:.2f}"


def _time_sdpa(backend: str, heads: int, head_dim: int, dtype: torch.dtype, training: bool) -> float:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch = max(1, TOKENS // ATTENTION_SEQ)
    q, k, v = (
        torch.randn(batch, heads, ATTENTION_SEQ, head_dim, device="cuda", dtype=dtype, requires_grad=training)
        for _ in range(3)
    )

    def run() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if training:
            out.sum().backward()

    def pinned() -> None:
        if backend == DEFAULT_DISPATCH:
            run()
        else:
            with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])]):
                run()

    try:
        return time_ms(pinned, DeviceTimer())
    except RuntimeError:  # "No available kernel": the backend does not take this shape or dtype here
        return -1.0
