"""The halves of an MLP (or an attention output) split across sibling modules, recognised and confirmed.

BERT-style layers call an "up" module, ``act(proj(x))``, and then a "down" module called with the branch and
the residual, ``norm(dropout(proj(branch)) + residual)``; the attention output is a module of the second shape
too.  ``patterns`` finds each by its one projection and the ops around it; the probes here confirm it on a
float64 copy with fresh parameters and inputs, outputs and gradients, and measure the activation, the norm's
variant, which input is the residual and the dropout probability training mode applies.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from adapt.model.activations import ACTIVATIONS
from operators.inventory import ModuleRecord, OpInventory
from operators.recognition import patterns as pat
from operators.recognition import variants
from operators.recognition.component import Component
from operators.recognition.norm_probe import eps_candidates, norm_inputs, norm_references
from operators.recognition.probe_cache import ProbeCache, structure_key
from operators.recognition.probes import close, first_tensor, float64_copy, grads_match, to_float64, with_fresh_hidden

_FAILURES = {
    "projection_activation": "no known activation of its projection's output matched",
    "projection_residual_norm": "norm(projection + residual) matched no LayerNorm or RMSNorm of its parameters",
}


def split_half_candidate(inv: OpInventory, rec: ModuleRecord) -> str | None:
    """The kind ``rec`` looks like if it is one half of a split MLP or attention output, else None."""
    if pat.is_projection_activation_candidate(inv, rec):
        return "projection_activation"
    if pat.is_projection_residual_norm_candidate(inv, rec):
        return "projection_residual_norm"
    return None


def classify_split_half(
    kind: str,
    module: nn.Module,
    rec: ModuleRecord,
    inv: OpInventory,
    generator,
    can_probe: bool,
    cache: ProbeCache,
    reject,
) -> Component | None:
    """The confirmed ``kind`` component of ``rec`` (pattern only when it cannot be probed), or None when its probe
    found another function."""
    proj = pat.lone_projection(inv, rec)
    local = proj.path[len(rec.path) + 1 :]
    if kind == "projection_activation":
        recorded = {"width": proj.in_features, "inner": proj.out_features, "projection": local}
        probe = probe_projection_activation
    else:
        norms = [p for p, r in inv.modules.items() if p.startswith(rec.path + ".") and pat.is_norm_candidate(r)]
        norm_module = norms[0][len(rec.path) + 1 :] if len(norms) == 1 else None
        recorded = {
            "width": proj.out_features,
            "inner": proj.in_features,
            "projection": local,
            "norm_module": norm_module,
        }
        probe = functools.partial(probe_projection_residual_norm, scalars=rec.scalars)
    call = inv.captured.get(rec.path)
    if not can_probe or call is None:
        return Component(rec.path, kind, variants.VARIANTS[kind](**recorded), False, "pattern only")
    run = functools.partial(probe, module, local, call, generator)
    key = (kind, *structure_key(module, rec, inv), _call_shape(call))
    measured, suffix = cache.verdict(key, rec.path, run)
    if measured is None:
        reject(rec.path, kind, _FAILURES[kind] + suffix)
        return None
    evidence = "float64 output+grad match" + suffix
    return Component(rec.path, kind, variants.VARIANTS[kind](**measured, **recorded), True, evidence)


def probe_projection_activation(
    module: nn.Module, projection: str, call: tuple[tuple, dict], generator
) -> dict[str, Any] | None:
    """Which activation of ``ACTIVATIONS`` the module applies to its projection's output; None: none does."""
    m = float64_copy(module, generator, scale=0.3).eval()
    proj = m.get_submodule(projection)
    x, args, kwargs = with_fresh_hidden(*call, generator)
    leaves = [x, *m.parameters()]

    def run() -> torch.Tensor:
        return first_tensor(m(*args, **kwargs))

    for name, act in ACTIVATIONS.items():
        with torch.no_grad():
            if not close(run(), act(proj(x))):
                continue
        if grads_match(run, lambda act=act: act(proj(x)), leaves, generator):
            return {"activation": name}
    return None


def probe_projection_residual_norm(
    module: nn.Module, projection: str, call: tuple[tuple, dict], generator, scalars: list[float]
) -> dict[str, Any] | None:
    """Which input is projected and which is the residual, and the norm of their sum (kind, eps, parameters);
    then the dropout training mode applies to the projection's output.  None: no such composition matches.

    The residual is drawn as ``z - proj(branch)`` so the norm sees ``z`` rows at tiny, unit and large magnitude,
    which tell LayerNorm from RMSNorm and one epsilon from another as the norm probe's inputs do."""
    m = float64_copy(module, generator, scale=0.3).eval()
    proj = m.get_submodule(projection)
    owned = {name for name, _ in proj.named_parameters(prefix=projection)}
    norm_params = {n: p for n, p in m.named_parameters() if p.dim() == 1 and n not in owned}
    eps_values = eps_candidates(scalars, module.modules())
    flat, spec = tree_flatten(call)
    slots = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if len(slots) != 2:
        return None
    flat = [to_float64(v) if v is None or isinstance(v, (torch.Tensor, bool, int, float, str)) else None for v in flat]
    for branch_at, residual_at in itertools.permutations(range(2)):
        branch_shape, residual_shape = flat[slots[branch_at]].shape, flat[slots[residual_at]].shape
        if branch_shape[-1] != proj.in_features or residual_shape[-1] != proj.out_features:
            continue
        h = torch.randn(branch_shape, generator=generator, dtype=torch.float64).requires_grad_(True)
        with torch.no_grad():
            r = (norm_inputs(tuple(residual_shape), generator) - proj(h)).requires_grad_(True)
        flat[slots[branch_at]], flat[slots[residual_at]] = h, r
        args, kwargs = tree_unflatten(flat, spec)

        def run(args=args, kwargs=kwargs) -> torch.Tensor:
            return first_tensor(m(*args, **kwargs))

        leaves = [h, r, *m.parameters()]
        for fields, norm in norm_references(norm_params, eps_values):
            with torch.no_grad():
                if not close(run(), norm(proj(h) + r)):
                    continue
            if grads_match(run, lambda norm=norm: norm(proj(h) + r), leaves, generator):
                dropout = _training_dropout(
                    m, run, lambda p, norm=norm: norm(F.dropout(proj(h), p) + r), leaves, generator
                )
                norm_fields = {"norm" if k == "kind" else k: v for k, v in fields.items()}
                return {**norm_fields, "branch_input": branch_at, "residual_input": residual_at, "dropout": dropout}
    return None


def _training_dropout(
    m: nn.Module, run: Callable[[], torch.Tensor], reference: Callable[[float], torch.Tensor], leaves, generator
) -> float | None:
    """The probability training mode drops the projection's output with: 0.0 when training mode computes the eval
    function, else the float attribute of the module (read by value) whose dropout replays its random draws exactly,
    outputs and gradients; None when none does.  The global generator is restored afterwards."""
    seed = int(torch.randint(1 << 30, (1,), generator=generator))

    def seeded(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            torch.manual_seed(seed)
            return fn()

        return call

    probabilities = sorted({v for s in m.modules() for v in vars(s).values() if isinstance(v, float) and 0.0 < v < 1.0})
    m.train()
    try:
        with torch.random.fork_rng(devices=[]):
            if grads_match(seeded(run), seeded(lambda: reference(0.0)), leaves, generator):
                return 0.0
            for p in probabilities:
                if grads_match(seeded(run), seeded(lambda p=p: reference(p)), leaves, generator):
                    return p
    finally:
        m.eval()
    return None


def _call_shape(call: tuple[tuple, dict]) -> tuple:
    """What of a captured call the probes keep besides the tensors they redraw: its layout and plain values."""
    flat, spec = tree_flatten(call)
    parts = [
        (tuple(v.shape), str(v.dtype))
        if isinstance(v, torch.Tensor)
        else repr(v)
        if v is None or isinstance(v, (bool, int, float, str))
        else type(v).__qualname__
        for v in flat
    ]
    return str(spec), tuple(parts)
