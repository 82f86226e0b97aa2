"""Numeric confirmation of a norm candidate: RMSNorm (offset 0 or 1) or LayerNorm, and its bf16 rounding order."""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from operators.recognition.probes import grads_match, redrawn_copy


def rms_reference(x, weight, eps, offset):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * (offset + weight)


def layer_norm_reference(x, weight, bias, eps):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def norm_inputs(shape: tuple[int, ...], generator) -> torch.Tensor:
    """Rows at tiny, unit and large magnitude in turn, with a common shift: separates mean-centred from RMS and
    eps-inside-sqrt from eps-outside."""
    base = torch.randn(shape, generator=generator, dtype=torch.float64)
    rows = base[..., 0].numel()
    scales = torch.tensor([1e-3, 1.0, 40.0], dtype=torch.float64).repeat(rows // 3 + 1)[:rows]
    scales = scales.view(*shape[:-1], 1)
    shift = torch.randn(shape[-1], generator=generator, dtype=torch.float64) * 0.3 + 0.7
    return base * scales + shift * scales


def eps_candidates(scalars: list[float], modules: Iterable[nn.Module]) -> list[float]:
    """Epsilons to try: small positive constants the trace passed to ops, and small float attributes of
    ``modules`` (read by value, never by name); [0.0] when there are none."""
    found = {s for s in scalars if 0.0 < s < 1e-2}
    found |= {v for m in modules for v in vars(m).values() if isinstance(v, float) and 0.0 < v < 1e-2}
    return sorted(found) or [0.0]


def norm_references(
    params: dict[str, nn.Parameter], eps_values: list[float]
) -> Iterator[tuple[dict[str, Any], Callable[[torch.Tensor], torch.Tensor]]]:
    """Every RMSNorm (offset 0 or 1) and LayerNorm that ``params`` (name -> 1-D parameter) and an epsilon
    could make: the fields that describe it and its float64 reference, most specific first."""
    for eps in eps_values:
        for w_name, b_name in _weight_bias_assignments(params):
            w = params[w_name] if w_name else None
            b = params[b_name] if b_name else None
            if b is None:
                for offset in (0.0, 1.0):
                    if w is None and offset:
                        continue
                    fields = {"kind": "rms_norm", "eps": eps, "offset": offset, "weight": w_name}
                    yield fields, functools.partial(rms_reference, weight=w, eps=eps, offset=offset)
            fields = {"kind": "layer_norm", "eps": eps, "weight": w_name, "bias": b_name}
            yield fields, functools.partial(layer_norm_reference, weight=w, bias=b, eps=eps)


def probe_norm(module: nn.Module, width: int, scalars: list[float], generator) -> dict[str, Any] | None:
    """RMSNorm (offset 0 or 1, any eps seen in the trace) or LayerNorm; returns the variant or None."""
    m = redrawn_copy(module, generator)
    params = dict(m.named_parameters(recurse=False))
    x = norm_inputs((3, 4, width), generator).requires_grad_(True)
    leaves = [x, *params.values()]
    for fields, reference in norm_references(params, eps_candidates(scalars, [module])):
        if grads_match(lambda: m(x), lambda: reference(x), leaves, generator):
            if fields["kind"] == "rms_norm":
                fields.update(_rms_cast(module, fields["weight"], fields["eps"], fields["offset"], width, generator))
            return fields
    return None


def _weight_bias_assignments(params: dict[str, nn.Parameter]) -> list[tuple[str | None, str | None]]:
    names = list(params)
    if not names:
        return [(None, None)]
    if len(names) == 1:
        return [(names[0], None)]
    return [(a, b) for a, b in itertools.permutations(names, 2)] if len(names) == 2 else []


def _rms_cast(
    module: nn.Module, w_name: str | None, eps: float, offset: float, width: int, generator
) -> dict[str, Any]:
    """Which rounding order the module uses in bf16: ``round_then_scale`` (normalise in fp32, round, then scale;
    Llama's) or ``scale_then_round`` (scale in fp32, round last; Gemma's).  Decided by which emulation reproduces the module bit for bit."""
    if w_name is None:
        return {"cast": "round_then_scale", "cast_evidence": "no weight"}
    m = copy.deepcopy(module).to(device="cpu", dtype=torch.bfloat16)
    weight = getattr(m, w_name)
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
    x = (torch.randn(64, width, generator=generator) * 3).to(torch.bfloat16)
    with torch.no_grad():
        out = m(x).float()
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        rounded_first = (normed.to(torch.bfloat16) * (offset + weight)).float()
        rounded_last = (normed * (offset + weight.float())).to(torch.bfloat16).float()
    mismatches = {
        "round_then_scale": int((out != rounded_first).sum()),
        "scale_then_round": int((out != rounded_last).sum()),
    }
    best = min(mismatches, key=mismatches.get)
    return {"cast": best, "cast_evidence": f"bf16 mismatches per emulation: {mismatches}"}
