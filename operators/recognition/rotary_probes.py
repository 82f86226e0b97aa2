"""Numeric confirmation of rotary embeddings: the (cos, sin) tables a generator emits, and the module-level
function an attention forward calls to rotate q and k."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from operators.recognition.probes import close, grads_match, redrawn_copy, to_float64, with_fresh_hidden


def probe_rotary_tables(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """Layout of the (cos, sin) tables a rotary generator emits: half-split or interleaved frequencies."""
    with torch.no_grad():
        out = copy.deepcopy(module).cpu()(*to_float64(tuple(args)), **to_float64(dict(kwargs)))
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        return None
    cos, sin = (t.double() for t in out)
    dim = cos.shape[-1]
    scale = float(cos.reshape(-1, dim)[0, 0])  # position 0: cos(0) * attention scaling
    if not close(cos.pow(2) + sin.pow(2), torch.full_like(cos, scale * scale), rtol=1e-5, atol=1e-6):
        return None
    half = dim // 2
    if torch.equal(cos[..., :half], cos[..., half:]):
        layout = "half"
    elif torch.equal(cos[..., 0::2], cos[..., 1::2]):
        layout = "interleaved"
    else:
        return None
    return {"kind": "rotary", "table_layout": layout, "rotary_dim": dim, "attention_scaling": round(scale, 6)}


ROTATION_STYLES = ("half", "interleaved", "deinterleaved")


def rotation_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate the first ``r`` dims of ``x`` ``[b, h, s, d]`` by HF-layout tables ``[b or 1, s, r]`` (``cat(f, f)``).

    ``half`` pairs dim i with i + r/2; ``interleaved`` pairs 2i with 2i+1 and writes them back in place;
    ``deinterleaved`` rotates the same pairs but writes the results as two halves (DeepSeek's MLA rope).
    """
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    c, s = cos[..., : r // 2].unsqueeze(1), sin[..., : r // 2].unsqueeze(1)
    x1, x2 = (rot[..., : r // 2], rot[..., r // 2 :]) if style == "half" else (rot[..., 0::2], rot[..., 1::2])
    a, b = x1 * c - x2 * s, x2 * c + x1 * s
    out = torch.stack([a, b], dim=-1).flatten(-2) if style == "interleaved" else torch.cat([a, b], dim=-1)
    return torch.cat([out, rest], dim=-1)


def forward_function(module: nn.Module) -> Callable:
    """The attention class's own ``forward`` under any decorators (``functools.wraps`` chains)."""
    return inspect.unwrap(type(module).forward)


def called_function(obj: Any) -> Callable | None:
    """The plain function a module-level global stands for: the function itself, or a stateless module that wraps
    one (a function turned into a layer, as the ``kernels`` package does to transformers' hub-kernel functions from
    transformers 5.25): the single plain function its ``forward`` closes over.  None for anything else."""
    if inspect.isfunction(obj):
        return obj
    if not isinstance(obj, nn.Module) or any(True for _ in obj.parameters()) or any(True for _ in obj.buffers()):
        return None
    if any(True for _ in obj.children()):
        return None
    forward = inspect.unwrap(type(obj).forward)
    inner = [c.cell_contents for c in forward.__closure__ or () if inspect.isfunction(c.cell_contents)]
    return inner[0] if len(inner) == 1 else None


def probe_rotary_application(
    module: nn.Module, args: tuple, kwargs: dict, generator
) -> tuple[dict[str, Any] | None, str]:
    """Find the global function ``module.forward`` calls to rotate (q, k), and its rotation style.

    Every plain function among the globals the forward references is wrapped for one float64 call of
    the module on its captured inputs, recording how it is called.  Each called candidate is then run
    on fresh float64 (q, k, cos, sin) of the recorded shapes against every rotation style; exactly one
    must match, output and gradients.  Returns (variant, evidence) or (None, reason).
    """
    fn = forward_function(module)
    scope = fn.__globals__
    names = [n for n in dict.fromkeys(fn.__code__.co_names) if called_function(scope.get(n)) is not None]
    calls = _record_global_calls(module, scope, names, args, kwargs, generator)
    matches, reasons = [], []
    for name, recorded in calls.items():
        verdict, why = _rotation_of(called_function(scope[name]), recorded, generator)
        if verdict is not None:
            matches.append((name, verdict))
        elif why:
            reasons.append(f"{name}: {why}")
    if not matches:
        called = ", ".join(calls) or "none"
        return None, f"no global function its forward calls (called: {called}) rotates (q, k) together; " + "; ".join(
            reasons
        )[:300]
    if len(matches) > 1:
        return None, f"ambiguous: {', '.join(n for n, _ in matches)} all rotate (q, k)"
    name, verdict = matches[0]
    variant = {
        "function": f"{scope.get('__name__')}.{name}",
        "global": name,
        "calls_per_forward": len(calls[name]),
        **verdict,
    }
    return (
        variant,
        f"float64 output+grad match of {name} as a {verdict['style']} rotation of the (q, k) it is called with",
    )


def _record_global_calls(module, scope: dict, names: list[str], args, kwargs, generator) -> dict[str, list]:
    """Positional/keyword arguments of every call the module's forward makes to ``scope[name]``."""
    calls: dict[str, list] = {}
    originals = {n: scope[n] for n in names}

    def recorder(name: str, original: Callable) -> Callable:
        def record(*a, **kw):
            calls.setdefault(name, []).append((a, kw))
            return original(*a, **kw)

        return record

    clone = redrawn_copy(module, generator, scale=0.2)
    _, call_args, call_kwargs = with_fresh_hidden(args, kwargs, generator)
    try:
        scope.update({n: recorder(n, f) for n, f in originals.items()})
        with torch.no_grad():
            clone(*call_args, **call_kwargs)
    finally:
        scope.update(originals)
    return calls


def _rotation_of(fn: Callable, recorded: list, generator) -> tuple[dict[str, Any] | None, str]:
    """The rotation style ``fn`` computes when called like ``recorded[0]``, or why it is no rotation."""
    try:
        bound = inspect.signature(fn).bind(*recorded[0][0], **recorded[0][1])
    except (TypeError, ValueError):
        return None, ""
    params = list(inspect.signature(fn).parameters.values())
    values = [bound.arguments.get(p.name) for p in params[:4]]
    # (q, k, freqs): the rotation as a complex product, each pair of dims one complex number (Llama 4's)
    complex_table = len(values) >= 3 and isinstance(values[2], torch.Tensor) and values[2].is_complex()
    taken = 3 if complex_table else 4
    if len(params) < taken or not all(
        isinstance(v, torch.Tensor) and (v.is_floating_point() or (complex_table and i == 2))
        for i, v in enumerate(values[:taken])
    ):
        return None, ""
    for p in params[taken:]:
        if p.name in bound.arguments and not is_default(bound.arguments[p.name], p.default):
            return None, f"called with {p.name}={bound.arguments[p.name]!r}; only its default was verified"
    if any(len(c[0]) + len(c[1]) != len(recorded[0][0]) + len(recorded[0][1]) for c in recorded):
        return None, "called with differing arguments within one forward"
    if complex_table:
        return _complex_rotation_of(fn, *values[:3], generator)
    q, k, cos, _ = values
    if (
        q.dim() != 4
        or k.dim() != 4
        or cos.dim() != 3
        or cos.shape[-2] != q.shape[2]
        or cos.shape[-1] % 2
        or cos.shape[-1] > q.shape[-1]
    ):
        return (
            None,
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}: not [b, h, s, d] with [b, s, r] tables",
        )
    qx, kx = _fresh(q, generator), _fresh(k, generator)
    cos_t, sin_t = _fresh_tables(cos.shape[:-1], cos.shape[-1] // 2, generator)
    for style in ROTATION_STYLES:
        matched = _matches(lambda: fn(qx, kx, cos_t, sin_t), qx, kx, cos_t, sin_t, style, "bhsd", generator)
        if matched is None:
            return None, ""
        if matched:
            return {"style": style, "rotary_dim": int(cos.shape[-1]), "head_dim": int(q.shape[-1])}, ""
    return None, "takes (q, k, cos, sin) but matches no rotation style"


def _complex_rotation_of(fn: Callable, q, k, freqs, generator) -> tuple[dict[str, Any] | None, str]:
    """``fn(q, k, freqs)`` against an interleaved rotation by ``freqs``' angles: its heads ``[b, h, s, d]`` or
    ``[b, s, h, d]`` (whichever axis the table's positions meet), the table ``[b or 1, s, r/2]`` of unit complex
    numbers ``cos + i sin``."""
    if q.dim() != 4 or k.dim() != 4 or freqs.dim() != 3 or 2 * freqs.shape[-1] > q.shape[-1]:
        return None, f"q {tuple(q.shape)}, k {tuple(k.shape)}, freqs {tuple(freqs.shape)}: not per-head pairs"
    qx, kx = _fresh(q, generator), _fresh(k, generator)
    cos_t, sin_t = _fresh_tables(freqs.shape[:-1], freqs.shape[-1], generator)
    half = freqs.shape[-1]
    table = torch.complex(cos_t[..., :half], sin_t[..., :half])
    for layout, axis in (("bhsd", 2), ("bshd", 1)):
        if q.shape[axis] != freqs.shape[-2]:
            continue
        matched = _matches(lambda: fn(qx, kx, table), qx, kx, cos_t, sin_t, "interleaved", layout, generator)
        if matched:
            rotary = {"style": "interleaved", "rotary_dim": 2 * half, "head_dim": int(q.shape[-1])}
            return {**rotary, "table": "complex", "layout": layout}, ""
    return None, "takes (q, k, complex table) but rotates no pairs of dims by its angles"


def _fresh(like: torch.Tensor, generator) -> torch.Tensor:
    return torch.randn(like.shape, generator=generator, dtype=torch.float64).requires_grad_(True)


def _fresh_tables(positions: tuple[int, ...], pairs: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of fresh angles in Hugging Face's ``cat(f, f)`` layout, ``[*positions, 2 * pairs]``."""
    angles = torch.rand((*positions, pairs), generator=generator, dtype=torch.float64) * 6.3
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


def _matches(call: Callable, qx, kx, cos_t, sin_t, style: str, layout: str, generator) -> bool | None:
    """Whether ``call()`` rotates (qx, kx) as ``style`` does, output and gradients; None: it failed to run."""

    def joined(pair) -> torch.Tensor:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            return torch.zeros(0)
        return torch.cat([t.reshape(-1) for t in pair])

    def reference(x: torch.Tensor) -> torch.Tensor:
        if layout == "bhsd":
            return rotation_reference(x, cos_t, sin_t, style)
        return rotation_reference(x.transpose(1, 2), cos_t, sin_t, style).transpose(1, 2)

    try:
        return grads_match(lambda: joined(call()), lambda: joined((reference(qx), reference(kx))), [qx, kx], generator)
    except Exception:  # a function that is no rotation may fail on these inputs in any way
        return None


def is_default(value: Any, default: Any) -> bool:
    """``value`` is what the parameter would be without it (tensors never count as defaults)."""
    if value is default:
        return True
    return (
        not isinstance(value, torch.Tensor)
        and default is not inspect.Parameter.empty
        and type(value) is type(default)
        and value == default
    )
