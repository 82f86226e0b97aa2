"""Numeric confirmation of candidate components: the module against a float64 reference of the kind.

Each probe works on a private float64 copy of the module with *fresh random parameters* (so an
all-ones or all-zeros initialisation cannot hide an offset or a swapped projection) and fresh
random inputs at several magnitudes, compares outputs and input/parameter gradients, and returns
the variant parameters that matched - or ``None``, in which case the module falls through to the
generic path.  A look-alike that computes something else therefore never gets a fused kernel.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

# Modules may upcast/downcast internally (e.g. RMSNorm computing in float32), so the float64 reference
# is matched at float32 resolution.  Every probe input is built so that the look-alike variants differ
# by O(1) relative error (tiny/large magnitudes, shifted means), far above this tolerance.
RTOL = 2e-5
ATOL = 2e-6

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu2": lambda x: F.relu(x).square(),
}


def float64_copy(module: nn.Module, generator: torch.Generator, scale: float = 0.5) -> nn.Module:
    """Independent CPU float64 copy of ``module`` with every parameter redrawn from N(0, scale^2).

    Probes always run on CPU: float64 everywhere, no TF32, and the model's device stays untouched."""
    clone = copy.deepcopy(module).to(device="cpu", dtype=torch.float64)
    with torch.no_grad():
        for param in clone.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * scale)
    return clone


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> bool:
    if a.shape != b.shape:
        return False
    a, b = a.detach(), b.detach()
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol * max(1.0, float(b.abs().max()))))


def grads_match(
    module_fn: Callable[[], torch.Tensor], ref_fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], generator
) -> bool:
    """Same output and same gradients of <out, g> for a fresh random cotangent g."""
    out = module_fn()
    ref = ref_fn()
    if not close(out, ref):
        return False
    cot = torch.randn(out.shape, generator=generator, dtype=out.dtype)
    got = torch.autograd.grad((out * cot).sum(), leaves, allow_unused=True)
    want = torch.autograd.grad((ref * cot).sum(), leaves, allow_unused=True)
    for g, w in zip(got, want):
        if (g is None) != (w is None) or (g is not None and not close(g, w, rtol=1e-4, atol=1e-5)):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------


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
    eps_values = sorted({s for s in scalars if 0.0 < s < 1e-2} | {v for v in vars(module).values() if isinstance(v, float) and 0.0 < v < 1e-2})
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
                        return {"kind": "rms_norm", "eps": eps, "offset": offset, "weight": w_name, **_rms_cast(module, w_name, eps, offset, width, generator)}
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


def _rms_cast(module: nn.Module, w_name: str | None, eps: float, offset: float, width: int, generator) -> dict[str, Any]:
    """Which rounding order the module uses in bf16: ``llama`` (normalise in fp32, cast, then scale)
    or ``gemma`` (scale in fp32, cast last).  Decided by which emulation reproduces the module bit for bit."""
    if w_name is None:
        return {"cast": "llama", "cast_evidence": "no weight"}
    m = copy.deepcopy(module).to(device="cpu", dtype=torch.bfloat16)
    weight = getattr(m, w_name)
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
    x = (torch.randn(64, width, generator=generator) * 3).to(torch.bfloat16)
    with torch.no_grad():
        out = m(x).float()
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        llama = (normed.to(torch.bfloat16) * (offset + weight)).float()
        gemma = (normed * (offset + weight.float())).to(torch.bfloat16).float()
    mismatches = {"llama": int((out != llama).sum()), "gemma": int((out != gemma).sum())}
    best = min(mismatches, key=mismatches.get)
    return {"cast": best, "cast_evidence": f"bf16 mismatches per emulation: {mismatches}"}


# ---------------------------------------------------------------------------------------------
# MLPs
# ---------------------------------------------------------------------------------------------


def probe_mlp(module: nn.Module, path: str, width: int, projections: list, generator) -> dict[str, Any] | None:
    """Gated (act(gate) * up -> down, separate or packed gate/up) or plain (act(up) -> down) MLP."""
    m = float64_copy(module, generator, scale=0.3)
    local = {p.path[len(path) + 1 :]: p for p in projections}
    subs = {name: m.get_submodule(name) for name in local}
    ups = [n for n, p in local.items() if p.in_features == width]
    downs = [n for n, p in local.items() if p.out_features == width and p.in_features != width]
    if len(downs) != 1:
        return None
    down = downs[0]
    inner = local[down].in_features
    x = torch.randn(2, 5, width, generator=generator, dtype=torch.float64).requires_grad_(True)
    leaves = [x, *m.parameters()]
    candidates: list[tuple[dict[str, Any], Callable[[], torch.Tensor]]] = []
    for act_name, act in ACTIVATIONS.items():
        if len(ups) == 2 and all(local[u].out_features == inner for u in ups):
            for gate, up in itertools.permutations(ups, 2):
                candidates.append(
                    (
                        {"kind": "gated_mlp", "activation": act_name, "gate": gate, "up": up, "down": down, "packed": False},
                        lambda act=act, gate=gate, up=up: subs[down](act(subs[gate](x)) * subs[up](x)),
                    )
                )
        if len(ups) == 1 and local[ups[0]].out_features == 2 * inner:
            for gate_first in (True, False):
                def packed(act=act, gate_first=gate_first):
                    a, b = subs[ups[0]](x).chunk(2, dim=-1)
                    g, u = (a, b) if gate_first else (b, a)
                    return subs[down](act(g) * u)

                candidates.append(({"kind": "gated_mlp", "activation": act_name, "gate": ups[0], "up": ups[0], "down": down, "packed": True, "gate_first": gate_first}, packed))
        if len(ups) == 1 and local[ups[0]].out_features == inner:
            candidates.append(({"kind": "mlp", "activation": act_name, "up": ups[0], "down": down}, lambda act=act, up=ups[0]: subs[down](act(subs[up](x)))))
    for variant, ref in candidates:
        with torch.no_grad():
            if not close(m(x), ref()):
                continue
        if grads_match(lambda: m(x), ref, leaves, generator):
            return variant
    return None


# ---------------------------------------------------------------------------------------------
# Rotary tables
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Attention: which keys each query can see, measured through gradients
# ---------------------------------------------------------------------------------------------


def to_float64(value: Any) -> Any:
    """Captured call arguments moved to CPU, floating tensors in float64."""
    if isinstance(value, torch.Tensor):
        return value.to(device="cpu", dtype=torch.float64) if value.is_floating_point() else value.cpu()
    if isinstance(value, tuple):
        return tuple(to_float64(v) for v in value)
    if isinstance(value, list):
        return [to_float64(v) for v in value]
    if isinstance(value, dict):
        return {k: to_float64(v) for k, v in value.items()}
    return value


def with_fresh_hidden(args: tuple, kwargs: dict, generator) -> tuple[torch.Tensor, tuple, dict]:
    """The captured call with its first tensor (the hidden states) replaced by fresh float64 noise."""
    flat, spec = tree_flatten((tuple(args), dict(kwargs)))
    first = next(i for i, v in enumerate(flat) if isinstance(v, torch.Tensor))
    x = torch.randn(flat[first].shape, generator=generator, dtype=torch.float64).requires_grad_(True)
    # Stateful helpers (KV caches) would replay the traced call's history: probe without them.
    flat = [to_float64(v) if v is None or isinstance(v, (torch.Tensor, bool, int, float, str)) else None for v in flat]
    flat[first] = x
    call_args, call_kwargs = tree_unflatten(flat, spec)
    return x, call_args, call_kwargs


def first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return first_tensor(out[0])
    return out[0]


def attention_visibility(module: nn.Module, args: tuple, kwargs: dict, generator) -> dict[str, Any]:
    """For every query position, the set of positions its output depends on (batch row 0).

    The mask semantics (causal, bidirectional, sliding window) come out of the module's own
    behaviour with the inputs the model really gave it, not from any attribute.
    """
    m = float64_copy(module, generator, scale=0.2)
    x, call_args, call_kwargs = with_fresh_hidden(args, kwargs, generator)
    out = first_tensor(m(*call_args, **call_kwargs))
    seq = x.shape[1]
    visible = []
    for i in range(seq):
        (grad,) = torch.autograd.grad(out[0, i].sum(), x, retain_graph=True)
        visible.append([j for j in range(seq) if float(grad[0, j].abs().max()) > 0.0])
    causal = all(max(v) <= i for i, v in enumerate(visible) if v)
    spans = [i - min(v) + 1 for i, v in enumerate(visible) if v]
    full = all(len(v) == (i + 1 if causal else seq) for i, v in enumerate(visible))
    window = None if full else (max(spans) if causal else None)
    return {"causal": causal, "window": window, "seq_len": seq}

