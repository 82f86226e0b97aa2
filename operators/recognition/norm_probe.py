"""Numeric confirmation of a norm candidate: RMSNorm (offset 0 or 1) or LayerNorm, and its bf16 rounding order."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from operators.recognition.probes import float64_copy, grads_match


def rms_reference(x, weight, eps, offset):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * (offset + weight)


def layer_norm_reference(x, weight, bias, eps):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def _norm_inputs(width: int, generator) -> torch.Tensor:
    """Rows at tiny, unit and large magnitude with a common shift: separates mean-centred from RMS and
    eps-inside-sqrt from eps-outside."""
    base = torch.randn(3, 4, width, generator=generator, dtype=torch.float64)
    scales = torch.tensor([1e-3, 1.0, 40.0], dtype=torch.float64).view(3, 1, 1)
    shift = torch.randn(1, 1, width, generator=generator, dtype=torch.float64) * 0.3 + 0.7
    return base * scales + shift * scales


def probe_norm(module: nn.Module, width: int, scalars: list[float], generator) -> dict[str, Any] | None:
    """RMSNorm (offset 0 or 1, any eps seen in the trace) or LayerNorm; returns the variant or None."""
    m = float64_copy(module, generator)
    params = dict(m.named_parameters(recurse=False))
    eps_values = sorted(
        {s for s in scalars if 0.0 < s < 1e-2}
        | {v for v in vars(module).values() if isinstance(v, float) and 0.0 < v < 1e-2}
    )
    if not eps_values:
        eps_values = [0.0]
    x = _norm_inputs(width, generator).requires_grad_(True)
    leaves = [x, *params.values()]
    for eps in eps_values:
        for w_name, b_name in _weight_bias_assignments(params):
            w = params[w_name] if w_name else None
            b = params[b_name] if b_name else None
            if b is None:
                for offset in (0.0, 1.0):
                    if w is None and offset:
                        continue
                    if grads_match(lambda: m(x), lambda: rms_reference(x, w, eps, offset), leaves, generator):
                        return {
                            "kind": "rms_norm",
                            "eps": eps,
                            "offset": offset,
                            "weight": w_name,
                            **_rms_cast(module, w_name, eps, offset, width, generator),
                        }
            if grads_match(lambda: m(x), lambda: layer_norm_reference(x, w, b, eps), leaves, generator):
                return {"kind": "layer_norm", "eps": eps, "weight": w_name, "bias": b_name}
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
