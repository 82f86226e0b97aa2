"""Numeric confirmation of candidate components: the module against a float64 reference of the kind.

Each probe works on a private float64 copy of the module with *fresh random parameters* (so an
all-ones or all-zeros initialisation cannot hide an offset or a swapped projection) and fresh
random inputs at several magnitudes, compares outputs and input/parameter gradients, and returns
the variant parameters that matched - or ``None``, in which case the module falls through to the
generic path.  A look-alike that computes something else therefore never gets a fused kernel.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from adapt.model.activations import ACTIVATIONS
from adapt.model.calls import without_cache

# Modules may upcast/downcast internally (e.g. RMSNorm computing in float32), so the float64 reference
# is matched at float32 resolution.  Every probe input is built so that the look-alike variants differ
# by O(1) relative error (tiny/large magnitudes, shifted means), far above this tolerance.
RTOL = 2e-5
ATOL = 2e-6


def float64_copy(module: nn.Module, generator: torch.Generator, scale: float = 0.5) -> nn.Module:
    """Independent CPU float64 copy of ``module`` with every parameter redrawn from N(0, scale^2).

    Probes always run on CPU: float64 everywhere, no TF32, and the model's device stays untouched.
    The module's own weights are never copied (they are redrawn anyway): the clone is built around
    meta stand-ins, then each parameter is drawn fresh.  Draws are made in float32 and widened, four
    times faster than float64 draws at 1B width; the probe's arithmetic stays float64 throughout."""
    stand_ins = {id(p): nn.Parameter(torch.empty(p.shape, device="meta"), p.requires_grad) for p in module.parameters()}
    clone = copy.deepcopy(module, memo=dict(stand_ins))
    drawn: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    for sub in clone.modules():
        for name, param in sub._parameters.items():
            if param is not None and id(param) not in drawn:
                value = torch.randn(param.shape, generator=generator, dtype=torch.float32).double() * scale
                drawn[id(param)] = nn.Parameter(value, param.requires_grad)
            if param is not None:
                sub._parameters[name] = drawn[id(param)]
        for name, buf in sub._buffers.items():
            if buf is not None:
                sub._buffers[name] = buf.to(device="cpu", dtype=torch.float64 if buf.is_floating_point() else buf.dtype)
    return clone


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
                        {
                            "kind": "gated_mlp",
                            "activation": act_name,
                            "gate": gate,
                            "up": up,
                            "down": down,
                            "packed": False,
                        },
                        lambda act=act, gate=gate, up=up: subs[down](act(subs[gate](x)) * subs[up](x)),
                    )
                )
        if len(ups) == 1 and local[ups[0]].out_features == 2 * inner:
            for gate_first in (True, False):

                def packed(act=act, gate_first=gate_first):
                    a, b = subs[ups[0]](x).chunk(2, dim=-1)
                    g, u = (a, b) if gate_first else (b, a)
                    return subs[down](act(g) * u)

                candidates.append(
                    (
                        {
                            "kind": "gated_mlp",
                            "activation": act_name,
                            "gate": ups[0],
                            "up": ups[0],
                            "down": down,
                            "packed": True,
                            "gate_first": gate_first,
                        },
                        packed,
                    )
                )
        if len(ups) == 1 and local[ups[0]].out_features == inner:
            candidates.append(
                (
                    {"kind": "mlp", "activation": act_name, "up": ups[0], "down": down},
                    lambda act=act, up=ups[0]: subs[down](act(subs[up](x))),
                )
            )
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


_PROBE_CORE_NAME = "adapt_probe_reference"


def attention_core_matches(
    module: nn.Module, args: tuple, kwargs: dict, variant: dict[str, Any], generator
) -> tuple[bool, str]:
    """Does the module still compute the same function when its attention core is the plain kernel?

    The kernel that replaces a hooked attention core sees (q, k, v, mask, scaling) and the recognised
    causal/window/softcap/GQA values, nothing else: learned sinks, relative-position terms or any other
    keyword the module hands its core are dropped.  So the float64 module is run twice on one fresh
    input, with its own core and with a float64 reference of that kernel, and must agree in output and
    in every gradient (a parameter only the model's own core reads gets no gradient through the kernel).
    """
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(_PROBE_CORE_NAME, functools.partial(_reference_core, variant=dict(variant)))
    m = float64_copy(module, generator, scale=0.2).eval()
    config = m.config
    own = config._attn_implementation
    x, call_args, call_kwargs = with_fresh_hidden(args, kwargs, generator)

    def run(implementation: str) -> torch.Tensor:
        config._attn_implementation = implementation
        try:
            return first_tensor(m(*call_args, **call_kwargs))
        finally:
            config._attn_implementation = own

    if grads_match(lambda: run(own), lambda: run(_PROBE_CORE_NAME), [x, *m.parameters()], generator):
        return True, "the module with a plain scaled-dot-product core reproduces its own float64 output and gradients"
    return (
        False,
        "its attention core computes more than scaled dot-product attention with the measured mask (e.g. sinks or position terms)",
    )


def _reference_core(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    variant: dict[str, Any],
    **_ignored,
):
    """Float64 scaled dot-product attention as the replacing kernel computes it; extra keywords are ignored as it ignores them."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scale
    cap = variant.get("softcap")
    if cap:
        scores = cap * torch.tanh(scores / cap)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask = (
        attention_mask[:, :, :, :kv_len] if attention_mask is not None and attention_mask.dim() == 4 else attention_mask
    )
    if mask is None:
        q_pos = torch.arange(q_len).view(-1, 1) + (kv_len - q_len)
        k_pos = torch.arange(kv_len).view(1, -1)
        mask = torch.ones(q_len, kv_len, dtype=torch.bool)
        if variant.get("causal", True):
            mask &= k_pos <= q_pos
        if variant.get("window"):
            mask &= (q_pos - k_pos) < int(variant["window"])
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.to(scores.dtype)
    return (torch.softmax(scores, dim=-1) @ value).transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------------------------------------
# Rotary application: the module-level function an attention forward calls to rotate q and k
# ---------------------------------------------------------------------------------------------

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
    names = [n for n in dict.fromkeys(fn.__code__.co_names) if inspect.isfunction(scope.get(n))]
    calls = _record_global_calls(module, scope, names, args, kwargs, generator)
    matches, reasons = [], []
    for name, recorded in calls.items():
        verdict, why = _rotation_of(scope[name], recorded, generator)
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

    clone = float64_copy(module, generator, scale=0.2)
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
    if len(params) < 4 or not all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in values):
        return None, ""
    q, k, cos, _ = values
    for p in params[4:]:
        if p.name in bound.arguments and not is_default(bound.arguments[p.name], p.default):
            return None, f"called with {p.name}={bound.arguments[p.name]!r}; only its default was verified"
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
    if any(len(c[0]) + len(c[1]) != len(recorded[0][0]) + len(recorded[0][1]) for c in recorded):
        return None, "called with differing arguments within one forward"
    qx = torch.randn(q.shape, generator=generator, dtype=torch.float64).requires_grad_(True)
    kx = torch.randn(k.shape, generator=generator, dtype=torch.float64).requires_grad_(True)
    angles = torch.rand((*cos.shape[:-1], cos.shape[-1] // 2), generator=generator, dtype=torch.float64) * 6.3
    cos_t, sin_t = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def joined(pair) -> torch.Tensor:
        return (
            torch.cat([t.reshape(-1) for t in pair])
            if isinstance(pair, (tuple, list)) and len(pair) == 2
            else torch.zeros(0)
        )

    for style in ROTATION_STYLES:
        try:
            matched = grads_match(
                lambda: joined(fn(qx, kx, cos_t, sin_t)),
                lambda style=style: joined(
                    (rotation_reference(qx, cos_t, sin_t, style), rotation_reference(kx, cos_t, sin_t, style))
                ),
                [qx, kx],
                generator,
            )
        except Exception:  # a function that is no rotation may fail on these inputs in any way
            return None, ""
        if matched:
            return {"style": style, "rotary_dim": int(cos.shape[-1]), "head_dim": int(q.shape[-1])}, ""
    return None, "takes (q, k, cos, sin) but matches no rotation style"


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


# ---------------------------------------------------------------------------------------------
# Vocabulary projection + cross-entropy
# ---------------------------------------------------------------------------------------------


_PROBE_LOGIT_SCALE = 60.0  # largest logit during the loss probe, about twice the usual final soft-caps


def probe_lm_head_loss(model: nn.Module, head_path: str, softcap: float | None, generator) -> tuple[bool, str]:
    """Does cross-entropy of ``softcap(decoder output @ head.weight.T)`` reproduce the model's own loss?

    Runs the linear-cross-entropy forward (``operators.providers.triton_head``) with a float64 PyTorch
    loss against the model's forward on fresh random tokens and labels (some ignored), comparing the
    loss and the head weight's gradient.  The head weight is scaled for the probe (and restored bit for
    bit) so the largest logit is about 60.  Returns (confirmed, evidence or reason).
    """
    from operators.providers.triton_head import (
        head_owner,
        linear_cross_entropy_forward,
        reference_linear_cross_entropy,
    )

    head = model.get_submodule(head_path)
    try:
        owner = head_owner(model, head)
        fused = linear_cross_entropy_forward(owner, softcap, reference_linear_cross_entropy)
    except (ValueError, AttributeError, NotImplementedError) as err:
        return False, f"no linear-cross-entropy forward: {err}"
    device = head.weight.device
    ids = torch.randint(0, head.weight.shape[0], (2, 9), generator=generator).to(device)
    labels = torch.where(torch.rand(ids.shape, generator=generator).to(device) < 0.25, -100, ids)
    extra = without_cache(owner)
    # Gradients upstream of the decoder output are the same computation in both paths; the head weight's
    # gradient (which includes the embedding's when tied) is where the loss composition can differ.
    # Asking for it alone skips every other weight gradient: the probe costs a forward at any depth.
    params = [head.weight]
    training, saved_weight = model.training, head.weight.detach().clone()
    model.eval()
    try:
        with torch.no_grad():  # logits of tens: a final soft-cap (or its absence) then changes the loss at O(1)
            logits = owner(input_ids=ids, **extra).logits
            head.weight.mul_(_PROBE_LOGIT_SCALE / max(float(logits.abs().max()), 1e-6))
        want = owner(input_ids=ids, labels=labels, **extra).loss
        got = fused(input_ids=ids, labels=labels, **extra).loss
        want_grads = torch.autograd.grad(want, params, allow_unused=True)
        got_grads = torch.autograd.grad(got, params, allow_unused=True)
    except Exception as err:  # a model whose loss is not this composition may fail anywhere in it
        return False, f"fused-loss forward failed: {type(err).__name__}: {str(err)[:160]}"
    finally:
        fused.release()
        model.train(training)
        with torch.no_grad():
            head.weight.copy_(saved_weight)
    if not close(got.float(), want.float(), rtol=1e-5, atol=1e-6):
        return False, f"loss {float(got.detach()):.6g} differs from the model's own {float(want.detach()):.6g}"
    for g, w in zip(got_grads, want_grads):
        if (g is None) != (w is None) or (g is not None and not close(g.float(), w.float(), rtol=1e-4, atol=1e-5)):
            return False, "loss matches but the head weight's gradient differs"
    return True, "float64 linear cross-entropy of the decoder output reproduces the model's loss and gradients"
