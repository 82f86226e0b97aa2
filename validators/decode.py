"""A fast decode path: a preallocated static KV cache, and the decode step compiled (CUDA graphs on a GPU).

Decoding one token is host-bound at small batches: every module call costs Python work, and a
patched model adds more.  ``StaticDecoder`` removes that per-token overhead: transformers'
``StaticCache`` keeps every tensor at a fixed address and shape, so the decode step (one forward
plus the greedy pick) compiles once with ``torch.compile`` and, with ``mode="reduce-overhead"``,
replays as one CUDA graph.  Kernel-plan patches compose with it because adapt's kernels are
``torch.library`` operators that Dynamo traces as single nodes.

Prefill and decode are timed separately, for the adapted path and for transformers' own
``generate`` (dynamic cache eager, and static cache, which ``generate`` compiles on a GPU).
"""

from __future__ import annotations

import copy
import functools
import inspect
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from adapt.model.calls import token_vocab
from adapt.model.skeleton import quiet_transformers
from validators.modules import first_tensor


def cache_keyword(model: nn.Module) -> str:
    """The forward's name for the KV cache: ``cache`` in newer transformers, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The cache a forward returned (None when the model keeps none), under either name."""
    if isinstance(output, dict):
        present = list(output.keys())  # plain names: asking for an old one makes transformers warn
        for key in ("cache", "past_key_values"):
            if key in present and output[key] is not None:
                return output[key]
    return None


def accepts(model: nn.Module, name: str) -> bool:
    params = inspect.signature(model.forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_static_cache(model: nn.Module, batch: int, max_len: int) -> Any:
    """transformers' StaticCache for ``batch`` sequences of up to ``max_len`` tokens (older signatures too)."""
    from transformers import StaticCache

    param = next(model.parameters())
    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # releases that size the cache up front
        return StaticCache(
            config=model.config, max_batch_size=batch, max_cache_len=max_len, device=param.device, dtype=param.dtype
        )


class StaticDecoder:
    """Greedy decoding of a fixed batch into a static cache, the decode step compiled once.

    ``compile=None`` means compile on CUDA only (Inductor on a CPU costs minutes of build for a
    gain that tests do not need); ``mode`` is handed to ``torch.compile``.
    """

    def __init__(
        self, model: nn.Module, batch: int, max_len: int, compile: bool | None = None, mode: str = "reduce-overhead"
    ):
        self.model = model
        self.device = next(model.parameters()).device
        self.batch, self.max_len = batch, max_len
        self.cache = make_static_cache(model, batch, max_len)
        self.cache_kw = cache_keyword(model)
        self.trim_logits = accepts(model, "logits_to_keep")
        self.compiled = self.device.type == "cuda" if compile is None else compile
        self.mode = mode
        self._step = (
            torch.compile(self._decode_step, mode=mode, fullgraph=False, dynamic=False)
            if self.compiled
            else self._decode_step
        )

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kwargs = {self.cache_kw: self.cache, "cache_position": positions, "use_cache": True}
        if self.trim_logits:
            kwargs["logits_to_keep"] = 1
        return first_tensor(self.model(input_ids=ids, **kwargs))[:, -1]

    def _decode_step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self._forward(token, position).argmax(-1, keepdim=True)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Reset the cache, run the prompt through it, return the first greedy token ``[batch, 1]``."""
        if ids.shape[0] != self.batch or ids.shape[1] >= self.max_len:
            raise ValueError(
                f"prompt {tuple(ids.shape)} does not fit a decoder for batch {self.batch}, length {self.max_len}"
            )
        self.cache.reset()
        with quiet_transformers():
            logits = self._forward(ids, torch.arange(ids.shape[1], device=self.device))
        return logits.argmax(-1, keepdim=True)

    @torch.no_grad()
    def decode(self, first: torch.Tensor, start: int, steps: int) -> torch.Tensor:
        """``steps`` more greedy tokens after ``first`` (at position ``start``); returns ``[batch, steps + 1]``."""
        if start + steps > self.max_len:
            raise ValueError(f"{start + steps} positions exceed the cache's {self.max_len}")
        tokens, token = [first], first
        with quiet_transformers():
            for offset in range(steps):
                position = torch.tensor([start + offset], device=self.device)
                token = self._step(token, position).clone()  # a CUDA graph's output is overwritten by its next replay
                tokens.append(token)
        return torch.cat(tokens, dim=1)

    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        return self.decode(self.prefill(ids), ids.shape[1], new_tokens - 1)


@dataclass
class DecodeTiming:
    """Prefill and decode of one variant at one batch size.  Decode rate counts tokens after the first."""

    variant: str
    batch: int
    prompt_len: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    ms_per_token: float
    tokens: list[list[int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    decode_spread: float | None = None  # slowest / fastest decode over the repeats
    gpu_idle_share: float | None = None  # of the decode's wall time, from the profiler (CUDA only)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gpu_idle_share(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Share of ``fn``'s wall time with no kernel running on the GPU (torch profiler, kernel intervals merged
    across streams).  None off CUDA, or when the profiler saw no kernel, rather than a made-up 100%."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    wall_us = (time.perf_counter() - start) * 1e6
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if "cuda" in str(getattr(e, "device_type", "")).lower()
    )
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:  # union of kernel intervals: overlapping streams count once
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return max(0.0, 1.0 - busy / wall_us) if spans and wall_us > 0 else None


def _spread(times: list[float]) -> float | None:
    return max(times) / min(times) if len(times) > 1 and min(times) > 0 else None


def _timed(fn, device: torch.device) -> tuple[float, Any]:
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def _timing(
    variant: str,
    ids: torch.Tensor,
    new_tokens: int,
    prefill_s: float,
    decode_s: float,
    tokens: torch.Tensor,
    notes: list[str],
    spread: float | None = None,
) -> DecodeTiming:
    batch, prompt_len = ids.shape
    decoded = batch * (new_tokens - 1)
    return DecodeTiming(
        variant=variant, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, prefill_s=prefill_s, decode_s=decode_s,
        prefill_tokens_per_s=batch * prompt_len / prefill_s, decode_tokens_per_s=decoded / decode_s if decode_s > 0 else 0.0,
        ms_per_token=1e3 * decode_s / max(new_tokens - 1, 1), tokens=tokens.tolist(), notes=notes, decode_spread=spread,
    )  # fmt: skip


def time_static_decoder(
    variant: str, model: nn.Module, ids: torch.Tensor, new_tokens: int, compile: bool | None = None, repeats: int = 3
) -> DecodeTiming:
    """Prefill and decode of ``StaticDecoder`` (medians over ``repeats`` after one warm-up that compiles)."""
    return warm_static_decoder(model, ids, new_tokens, compile).measure(variant, repeats)


@dataclass
class WarmDecoder:
    """A ``StaticDecoder`` whose step is compiled and captured for one prompt batch, ready to be timed.

    Warming and timing are separate so that a benchmark can compile several decoders (in several
    processes) at once and time each alone afterwards.
    """

    decoder: StaticDecoder
    ids: torch.Tensor
    new_tokens: int

    def measure(self, variant: str, repeats: int = 3, idle_steps: int = 32) -> DecodeTiming:
        """Medians over ``repeats``; on CUDA also the GPU idle share over ``idle_steps`` decode steps."""
        decoder, ids, steps = self.decoder, self.ids, self.new_tokens - 1
        prefills, decodes, tokens = [], [], None
        for _ in range(repeats):
            prefill_s, first = _timed(lambda: decoder.prefill(ids), decoder.device)
            decode_s, tokens = _timed(functools.partial(decoder.decode, first, ids.shape[1], steps), decoder.device)
            prefills.append(prefill_s)
            decodes.append(decode_s)
        first = decoder.prefill(ids)
        idle = gpu_idle_share(
            functools.partial(decoder.decode, first, ids.shape[1], min(idle_steps, steps)), decoder.device
        )
        notes = [f"static cache, decode step {'compiled, mode=' + decoder.mode if decoder.compiled else 'eager'}"]
        timing = _timing(
            variant, ids, self.new_tokens, statistics.median(prefills), statistics.median(decodes), tokens, notes,
            _spread(decodes),
        )  # fmt: skip
        timing.gpu_idle_share = idle
        return timing


def warm_static_decoder(
    model: nn.Module, ids: torch.Tensor, new_tokens: int, compile: bool | None = None
) -> WarmDecoder:
    """A decoder for ``ids``' batch, after one full generation that compiles and captures the step."""
    if new_tokens < 2:
        raise ValueError("timing decode needs at least 2 new tokens")
    decoder = StaticDecoder(model, ids.shape[0], ids.shape[1] + new_tokens, compile=compile)
    decoder.generate(ids, new_tokens)
    return WarmDecoder(decoder, ids, new_tokens)


def time_hf_generate(
    variant: str, model: nn.Module, ids: torch.Tensor, new_tokens: int, static: bool, repeats: int = 3
) -> DecodeTiming:
    """transformers' own greedy ``generate``: prefill = a 1-token generate, decode = the rest of an N-token one.

    ``static=True`` asks for ``cache_implementation="static"``, which ``generate`` compiles on a GPU
    (its default compile config); ``static=False`` is the dynamic cache, eager.
    """
    return warm_hf_generate(model, ids, new_tokens, static).measure(variant, repeats)


@dataclass
class WarmGenerate:
    """transformers' ``generate`` on one prompt batch, compiled where it compiles, ready to be timed."""

    model: nn.Module
    ids: torch.Tensor
    new_tokens: int
    static: bool

    def run(self, n: int) -> torch.Tensor:
        """Greedy for exactly ``n`` tokens, end-of-sequence taken like any other argmax (as the static decoder
        does): no stop, and no ``min_new_tokens``, which would suppress it and pick the runner-up instead."""
        ids = self.ids
        config = copy.deepcopy(self.model.generation_config)
        pad = config.pad_token_id
        # An empty list, not None: generate() refills None from the model's own config and would stop at it.
        config.eos_token_id, config.do_sample, config.pad_token_id = [], False, 0 if pad is None else pad
        kwargs: dict[str, Any] = {"attention_mask": torch.ones_like(ids)}
        if self.static:
            kwargs["cache_implementation"] = "static"
        with quiet_transformers(), torch.no_grad():
            return self.model.generate(ids, generation_config=config, max_new_tokens=n, **kwargs)

    def measure(self, variant: str, repeats: int = 3) -> DecodeTiming:
        device, new_tokens = self.ids.device, self.new_tokens
        prefills, totals, out = [], [], None
        for _ in range(repeats):
            prefills.append(_timed(lambda: self.run(1), device)[0])
            total, out = _timed(lambda: self.run(new_tokens), device)
            totals.append(total)
        prefill_s = statistics.median(prefills)
        decode_s = max(statistics.median(totals) - prefill_s, 1e-9)
        notes = ["generate(), static cache" + (" (compiled by generate on this device)" if device.type == "cuda" else "")
                 if self.static else "generate(), dynamic cache, eager"]  # fmt: skip
        spread = _spread([max(t - prefill_s, 1e-9) for t in totals])
        return _timing(variant, self.ids, new_tokens, prefill_s, decode_s, out[:, self.ids.shape[1] :], notes, spread)


def warm_hf_generate(model: nn.Module, ids: torch.Tensor, new_tokens: int, static: bool) -> WarmGenerate:
    """``generate`` warmed for ``ids``: with a static cache, one full-length call sizes the cache (later shorter
    calls reuse its length) and compiles the decode step; the dynamic cache needs only a short call."""
    if new_tokens < 2:
        raise ValueError("timing decode needs at least 2 new tokens")
    warm = WarmGenerate(model, ids, new_tokens, static)
    warm.run(1)
    warm.run(new_tokens if static else min(new_tokens, 8))
    return warm


def decode_comparison(
    src,
    transform: Any = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    batches: tuple[int, ...] = (1, 8),
    prompt_len: int = 512,
    new_tokens: int = 256,
    repeats: int = 3,
    seed: int = 0,
) -> list[DecodeTiming]:
    """Decode rates in one run: HF eager (dynamic cache), HF static cache (compiled by ``generate`` on a GPU),
    and the adapted model (``transform`` applied) on ``StaticDecoder``, every variant on the same prompts."""
    from adapt.model.skeleton import load_model

    timings = []
    for variant in ("hf-eager", "hf-static-compile", "adapted"):
        model = load_model(src, dtype, device).eval()
        if variant == "adapted" and transform is not None:
            model = transform(model) or model
        vocab = token_vocab(model)
        for batch in batches:
            ids = torch.randint(
                0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed + batch)
            ).to(device)
            if variant == "adapted":
                timings.append(time_static_decoder(variant, model, ids, new_tokens, repeats=repeats))
            else:
                timings.append(
                    time_hf_generate(
                        variant, model, ids, new_tokens, static=variant == "hf-static-compile", repeats=repeats
                    )
                )
        del model
    return timings
