"""The halves of an MLP (or an attention output) split across sibling modules, recognised and confirmed.

BERT-style layers call an "up" module, ``act(proj(x))``, and then a "down" module called with the branch and
the residual, ``norm(dropout(proj(branch)) + residual)``; the attention output is a module of the second shape
too.  Each may or may not normalise last: BERT's prediction-head transform is ``norm(act(proj(x)))``, and a
pre-norm layer's down half (Megatron-BERT's) adds without a norm.  ``patterns`` finds each by its one projection
and the ops around it; the probes here confirm it on a float64 copy with fresh parameters and inputs, outputs and
gradients, and measure the activation, the norm's variant (or its absence), which input is the residual and the
dropout probability training mode applies.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from operators.recognition.probes import close, first_tensor, grads_match, redrawn_copy, to_float64, with_fresh_hidden

_FAILURES = {
    "projection_activation": "no known activation of its projection's output, normalised last or not, matched",
    "projection_residual_norm": "projection + residual matched neither a plain sum nor a LayerNorm or RMSNorm of it",
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
    norms = [p for p, r in inv.modules.items() if p.startswith(rec.path + ".") and pat.is_norm_candidate(r)]
    norm_module = norms[0][len(rec.path) + 1 :] if len(norms) == 1 else None
    if kind == "projection_activation":
        recorded = {"width": proj.in_features, "inner": proj.out_features, "projection": local}
        probe = functools.partial(probe_projection_activation, scalars=rec.scalars)
    else:
        recorded = {"width": proj.out_features, "inner": proj.in_features, "projection": local}
        probe = functools.partial(probe_projection_residual_norm, scalars=rec.scalars)
    call = inv.captured.get(rec.path)
    if not can_probe or call is None:
        return Component(
            rec.path, kind, variants.VARIANTS[kind](**recorded, norm_module=norm_module), False, "pattern only"
        )
    run = functools.partial(probe, module, local, call, generator)
    key = (kind, *structure_key(module, rec, inv), _call_shape(call))
    measured, suffix = cache.verdict(key, rec.path, run)
    if measured is None:
        reject(rec.path, kind, _FAILURES[kind] + suffix)
        return None
    evidence = "float64 output+grad match" + suffix
    recorded["norm_module"] = norm_module if measured["norm"] is not None else None
    return Component(rec.path, kind, variants.VARIANTS[kind](**measured, **recorded), True, evidence)


def probe_projection_activation(
    module: nn.Module, projection: str, call: tuple[tuple, dict], generator, scalars: list[float]
) -> dict[str, Any] | None:
    """Which activation of ``ACTIVATIONS`` the module applies to its projection's output, and the norm it applies
    after (kind, eps, parameters), if any; None: no such composition matches.

    Two settings must both match: fresh parameters on unit-scale inputs, then inputs whose rows are tiny, unit and
    large (the norm probe's) with the projection's 1-D parameters zeroed, so the activation's output, and the
    norm's input, keeps those magnitudes: they tell LayerNorm from RMSNorm and one epsilon from another."""
    eps_values = eps_candidates(scalars, module.modules())
    settings = [_activation_setting(module, projection, call, generator, magnitudes) for magnitudes in (False, True)]
    for name, act in ACTIVATIONS.items():
        for fields, norms in _norms_after(settings, eps_values):
            references = [
                lambda s=s, norm=norm, act=act: norm(act(s.projection(s.x))) for s, norm in zip(settings, norms)
            ]
            with torch.no_grad():
                if not all(close(s.run(), ref()) for s, ref in zip(settings, references)):
                    continue
            if all(grads_match(s.run, ref, s.leaves, generator) for s, ref in zip(settings, references)):
                return {"activation": name, **fields}
    return None


@dataclass
class _Setting:
    """A float64 copy of a module with fresh parameters (its projection, its other 1-D parameters and a call of
    it) and the fresh input it is called with."""

    projection: nn.Module
    x: torch.Tensor
    run: Callable[[], torch.Tensor]
    leaves: list[torch.Tensor]
    norm_params: dict[str, nn.Parameter]


def _activation_setting(
    module: nn.Module, projection: str, call: tuple[tuple, dict], generator, magnitudes: bool
) -> _Setting:
    m = redrawn_copy(module, generator, scale=0.3).eval()
    proj = m.get_submodule(projection)
    x, args, kwargs = with_fresh_hidden(*call, generator)
    if magnitudes:
        with torch.no_grad():
            x.copy_(norm_inputs(tuple(x.shape), generator))
            for p in proj.parameters():
                if p.dim() == 1:
                    p.zero_()
    owned = {name for name, _ in proj.named_parameters(prefix=projection)}
    norm_params = {n: p for n, p in m.named_parameters() if p.dim() == 1 and n not in owned}

    def run() -> torch.Tensor:
        return first_tensor(m(*args, **kwargs))

    return _Setting(proj, x, run, [x, *m.parameters()], norm_params)


def _norms_after(
    settings: list[_Setting], eps_values: list[float]
) -> Iterator[tuple[dict[str, Any], list[Callable[[torch.Tensor], torch.Tensor]]]]:
    """No norm, then every norm the settings' parameters could make, as (variant fields, one reference per
    setting): the settings hold copies of one module, so their candidates come in the same order."""
    yield {"norm": None}, [_unchanged] * len(settings)
    for candidates in zip(*(norm_references(s.norm_params, eps_values) for s in settings)):
        fields = {"norm" if k == "kind" else k: v for k, v in candidates[0][0].items()}
        yield fields, [norm for _, norm in candidates]


def _unchanged(y: torch.Tensor) -> torch.Tensor:
    return y


def probe_projection_residual_norm(
    module: nn.Module, projection: str, call: tuple[tuple, dict], generator, scalars: list[float]
) -> dict[str, Any] | None:
    """Which input is projected and which is the residual, and the norm of their sum (kind, eps, parameters), if
    any; then the dropout training mode applies to the projection's output.  None: no such composition matches.

    The residual is drawn as ``z - proj(branch)`` so the norm sees ``z`` rows at tiny, unit and large magnitude,
    which tell LayerNorm from RMSNorm and one epsilon from another as the norm probe's inputs do."""
    m = redrawn_copy(module, generator, scale=0.3).eval()
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
        for fields, norm in [({"kind": None}, _unchanged), *norm_references(norm_params, eps_values)]:
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
