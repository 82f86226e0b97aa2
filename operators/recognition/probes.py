"""Numeric confirmation of candidate components: the module against a float64 reference of the kind.

Each probe works on a private float64 copy of the module with *fresh random parameters* (so an
all-ones or all-zeros initialisation cannot hide an offset or a swapped projection) and fresh
random inputs at several magnitudes, compares outputs and input/parameter gradients, and returns
the variant parameters that matched - or ``None``, in which case the module falls through to the
generic path.  A look-alike that computes something else therefore never gets a fused kernel.

This module holds what every probe shares (the float64 copy, the comparison, the replay of a captured
call); the probes themselves are one module per kind (``norm_probe``, ``mlp_probe``, ``rotary_probes``,
``attention_probes``, ``head_probe``, ``moe``, ``split_halves``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

# Modules may upcast/downcast internally (e.g. RMSNorm computing in float32), so the float64 reference
# is matched at float32 resolution.  Every probe input is built so that the look-alike variants differ
# by O(1) relative error (tiny/large magnitudes, shifted means), far above this tolerance.
RTOL = 2e-5
ATOL = 2e-6


def redrawn_copy(
    module: nn.Module, generator: torch.Generator, scale: float = 0.5, dtype: torch.dtype = torch.float64
) -> nn.Module:
    """Independent CPU copy of ``module`` in ``dtype`` (float64 unless asked) with every parameter redrawn from
    N(0, scale^2).

    Probes always run on CPU: float64 everywhere, no TF32, and the model's device stays untouched.
    The module's own weights are never copied (they are redrawn anyway): the clone is built around
    meta stand-ins, then each parameter is drawn fresh.  Draws are made in float32 and widened, four
    times faster than float64 draws at 1B width; the probe's arithmetic stays float64 throughout.

    ``dtype=torch.float32`` keeps the draws as drawn, for a module that cannot run in float64 (grouped-GEMM
    experts) and whose reference widens the same values itself: at a 604 M-parameter expert bank, widening
    the whole copy and narrowing it back cost four times the draws."""
    stand_ins = {id(p): nn.Parameter(torch.empty(p.shape, device="meta"), p.requires_grad) for p in module.parameters()}
    clone = copy.deepcopy(module, memo=dict(stand_ins))
    drawn: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    for sub in clone.modules():
        for name, param in sub._parameters.items():
            if param is not None and id(param) not in drawn:
                value = _normal(param.shape, generator).to(dtype).mul_(scale)
                drawn[id(param)] = nn.Parameter(value, param.requires_grad)
            if param is not None:
                sub._parameters[name] = drawn[id(param)]
        for name, buf in sub._buffers.items():
            if buf is not None:
                sub._buffers[name] = buf.to(device="cpu", dtype=dtype if buf.is_floating_point() else buf.dtype)
    return clone


_DRAW_CHUNK = 1 << 22  # values per independently seeded piece of a large draw


def _normal(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """float32 N(0, 1) values, deterministic in ``generator``.  A large tensor is drawn in pieces, each from its own
    generator seeded by ``generator``, on a thread per core: one CPU generator draws serially, and an MoE expert bank
    of 604 M values took seconds that way."""
    out = torch.empty(shape, dtype=torch.float32)
    flat = out.view(-1)
    if flat.numel() <= _DRAW_CHUNK:
        return torch.randn(shape, generator=generator, out=out)
    pieces = flat.split(_DRAW_CHUNK)
    seeds = torch.randint(1 << 62, (len(pieces),), generator=generator).tolist()

    def draw(piece: torch.Tensor, seed: int) -> None:
        torch.randn(piece.shape, generator=torch.Generator().manual_seed(seed), out=piece)

    with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:
        list(pool.map(draw, pieces, seeds))
    return out


def float32_sum_tolerance(terms: int) -> float:
    """``close``'s absolute tolerance (a share of the reference's largest value) for a module that must run in float32
    against a float64 reference: rounding grows with the square root of the terms summed into each output (the
    experts' two projections: 2816 at Qwen3-30B-A3B's width, about 5e-6 of the output's scale, measured, where ATOL
    allows 2e-6), so the tolerance is 32 float32 rounding steps per root term.  A wrong reading of the module (another
    activation, normalisation or scale, the halves swapped) is off by a share of 1e-2 or more."""
    return max(ATOL, 32 * torch.finfo(torch.float32).eps * terms**0.5)


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> bool:
    """``|a - b| <= atol * max(1, max|b|) + rtol * |b|`` everywhere; any NaN fails.

    Two passes with in-place temporaries instead of ``torch.allclose`` (whose isclose builds several
    full-size temporaries): six times faster on the 17M-element weight gradients of a 1B-wide MLP."""
    if a.shape != b.shape:
        return False
    a, b = a.detach(), b.detach()
    if a.numel() == 0:
        return True
    scale = b.abs()
    bound = atol * max(1.0, float(scale.max()))
    excess = (a - b).abs_().sub_(scale.mul_(rtol))
    return bool(excess.max() <= bound)


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
