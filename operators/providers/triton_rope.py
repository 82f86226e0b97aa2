"""Rotary embedding through ``operators.kernels.apply_rotary`` inside the model's own attention forward.

Hugging Face attention forwards rotate q and k by calling a function of their modelling module
(its name differs between models).  Recognition found that function numerically and its rotation
style; here it is replaced, in the module's globals, by a dispatcher that runs the Triton kernel
only while a patched attention module is executing (a stack the patched forward pushes on and pops
off) and the original function otherwise.  The unpatched reference model of an alignment run shares
those globals and is therefore untouched.  The swap is reference-counted (``operators.global_swap``).
Everything on the call path is plain Python that Dynamo follows (a list, positional binding), so a
patched model compiles with ``fullgraph=True``; a ``ContextVar`` or ``inspect.Signature.bind`` would not.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from operators.recognition.component import Component
from operators.recognition.rotary_probes import called_function, forward_function, is_default


@dataclass(frozen=True)
class RotarySpec:
    """What the running patched module asked for: which original function to stand in for, and how."""

    original: Callable[..., Any]
    style: str  # "half" | "interleaved" | "deinterleaved" (see rotary_probes.rotation_reference)
    module: str


_ACTIVE: list[RotarySpec] = []  # innermost running patched module last


@contextlib.contextmanager
def running(spec: RotarySpec) -> Iterator[None]:
    """The dispatcher serves ``spec`` while this block runs (the patched module's forward)."""
    _ACTIVE.append(spec)
    try:
        yield
    finally:
        _ACTIVE.pop()


def rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k ``[b, h, s, d]`` rotated in one kernel launch; ``deinterleaved`` regroups the pairs first
    (one copy each of q and k's rotary dims) so the half-rotation kernel writes DeepSeek's layout."""
    from operators import kernels

    if style == "deinterleaved":
        rotary_dim = cos.shape[-1]
        q, k = _deinterleave(q, rotary_dim), _deinterleave(k, rotary_dim)
    return kernels.apply_rotary(q, k, cos, sin, interleaved=style == "interleaved")


def _deinterleave(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    pairs = x[..., :rotary_dim].unflatten(-1, (rotary_dim // 2, 2)).transpose(-1, -2).flatten(-2)
    return pairs if x.shape[-1] == rotary_dim else torch.cat([pairs, x[..., rotary_dim:]], dim=-1)


def rotary_dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """Stand-in for ``original``: the kernel while a patched module that asked for it runs, else ``original``.

    Recognition verified ``original`` only at the defaults of its parameters past (q, k, cos, sin); a
    call that sets any of them differently is a recognition gap and raises rather than guessing.
    """
    function = called_function(original)  # (the function a stateless wrapper module stands for has the signature)
    params = list(inspect.signature(function).parameters.values())
    names = [p.name for p in params]

    @functools.wraps(function)
    def dispatch(*args, **kwargs):
        spec = _ACTIVE[-1] if _ACTIVE else None
        if spec is None or spec.original is not original:
            return original(*args, **kwargs)
        bound = {**dict(zip(names, args)), **kwargs}
        for p in params[4:]:
            if p.name in bound and not is_default(bound[p.name], p.default):
                raise RuntimeError(
                    f"{spec.module}: {function.__name__} called with {p.name}={bound[p.name]!r}, "
                    "which recognition did not verify"
                )
        q, k, cos, sin = (bound[name] for name in names[:4])
        return rotate(q, k, cos, sin, spec.style)

    dispatch.adapt_original = original
    return dispatch


def rotary_forward(module: nn.Module, component: Component):
    """adapt-triton factory: swaps the recognised global for the dispatcher and wraps ``module.forward``
    so the dispatcher knows this module is running.  The returned forward carries ``release``."""
    from operators.global_swap import swap_global

    v = component.variant
    scope = forward_function(module).__globals__
    if f"{scope.get('__name__')}.{v.global_name}" != v.function:
        raise RuntimeError(f"{component.module}: forward no longer resolves {v.function}")
    swap = swap_global(scope, v.global_name, rotary_dispatcher)
    spec = RotarySpec(swap.original, v.style, component.module)
    inner = module.forward

    def forward(*args, **kwargs):
        _ACTIVE.append(spec)  # not ``running(spec)``: Dynamo follows try/finally more surely than a generator
        try:
            return inner(*args, **kwargs)
        finally:
            _ACTIVE.pop()

    forward.release = swap.release
    return forward


def self_test_cases(gen: torch.Generator) -> dict[str, tuple]:
    """(kernel, float64 reference, inputs) per rotation style for the provider's self-test: GQA heads,
    partial rotary (8 of 12 dims), tables in Hugging Face's ``cat(f, f)`` layout."""
    from operators.recognition.rotary_probes import rotation_reference

    angles = torch.rand(1, 5, 4, generator=gen) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k = torch.randn(2, 4, 5, 12, generator=gen), torch.randn(2, 2, 5, 12, generator=gen)

    def case(style: str) -> tuple:
        def kernel(q, k):
            qo, ko = rotate(q, k, cos.to(q.device), sin.to(q.device), style)
            return torch.cat([qo.flatten(), ko.flatten()])

        def reference(q, k):
            return torch.cat([rotation_reference(t, cos.double(), sin.double(), style).flatten() for t in (q, k)])

        return kernel, reference, (q, k)

    return {f"rotary_{style}": case(style) for style in ("half", "interleaved", "deinterleaved")}
