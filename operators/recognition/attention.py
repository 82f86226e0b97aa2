"""Attention components: heads, core, soft-cap, sinks, rotary style and MLA read from the traced sequence; mask,
replaceable core and rotary application confirmed by the attention and rotary probes."""

from __future__ import annotations

import functools
from typing import Any

from adapt.model.structure import named_kv_heads
from operators.inventory import ModuleRecord, OpInventory
from operators.recognition import patterns as pat
from operators.recognition import variants
from operators.recognition.attention_probes import attention_core_matches, attention_visibility
from operators.recognition.component import Component
from operators.recognition.probe_cache import ProbeCache, structure_key
from operators.recognition.rotary_probes import probe_rotary_application


def rotary_application(module, path: str, inv: OpInventory, generator, cache: ProbeCache) -> Component:
    """The global function the attention forward rotates (q, k) with, probed once per distinct structure;
    unconfirmed (no kernel offered) with the reason when none is found."""
    key = ("rotary_application", *structure_key(module, inv.modules[path], inv, call_inputs=True))
    run = functools.partial(probe_rotary_application, module, *inv.captured[path], generator)
    (variant, evidence), suffix = cache.verdict(key, path, run)
    fields = {("global_name" if k == "global" else k): v for k, v in (variant or {}).items()}
    return Component(
        path, "rotary_application", variants.RotaryApplicationVariant(**fields), variant is not None, evidence + suffix
    )


def classify_attention(
    module, rec: ModuleRecord, inv: OpInventory, generator, can_probe: bool, cache: ProbeCache
) -> Component:
    """The attention component ``rec`` is: its shape from the trace, confirmed by the visibility probe (and, where the
    core is replaceable through transformers' hook, by running the module with a plain core)."""
    variant = attention_shape(inv, rec, module)
    # transformers' attention-function hook: the module resolves its core through config._attn_implementation
    variant["hook"] = hasattr(getattr(module, "config", None), "_attn_implementation")
    evidence = "pattern"
    if can_probe and rec.path in inv.captured:
        run = functools.partial(attention_visibility, module, *inv.captured[rec.path], generator)
        visibility, suffix = cache.verdict(structure_key(module, rec, inv, call_inputs=True), rec.path, run)
        variant.update(visibility)
        evidence = "visibility measured through float64 gradients" + suffix
        if variant["hook"]:  # the core is replaceable: the replacement must compute the whole function
            key = ("attention_core", *structure_key(module, rec, inv, call_inputs=True))
            run = functools.partial(attention_core_matches, module, *inv.captured[rec.path], dict(variant), generator)
            (same, why), suffix = cache.verdict(key, rec.path, run)
            evidence += "; " + why + suffix
            if not same:
                return Component(rec.path, "attention", _attention_variant(variant), False, evidence)
    return Component(rec.path, "attention", _attention_variant(variant), can_probe, evidence)


def _attention_variant(measured: dict[str, Any]) -> variants.AttentionVariant:
    """The typed variant of what ``attention_shape`` and the visibility probe measured."""
    rope, latent = measured.get("rope"), measured.get("latent_projections")
    return variants.AttentionVariant(
        **{
            **measured,
            "rope": variants.RopeStyle(**rope) if rope else None,
            "latent_projections": tuple(latent) if latent is not None else None,
        }
    )


_BATCHED_PRODUCTS = ("aten.bmm.default", "aten.baddbmm.default")


def attention_shape(inv: OpInventory, rec: ModuleRecord, module: Any = None) -> dict[str, Any]:
    """Heads, head dims, core, soft-capping, sinks, rotary style and MLA from the traced sequence (and, given the
    module, the KV head count it names where a projection bears it out)."""
    seq = rec.sequence
    width = pat.last_dim(rec.input_shapes)
    batch = rec.input_shapes[0][0]
    sdpa = next((e for e in seq if e[0].startswith(pat.SDPA_PREFIX)), None)
    if sdpa is not None:
        q, k, v = sdpa[1][:3]
        heads, head_dim, kv_heads_core, v_dim = q[1], q[-1], k[1], v[-1]
        core = "sdpa"
    else:
        # the scores' and the values' batched products; ``baddbmm`` adds a bias first (BLOOM's ALiBi): its operands
        # follow that bias
        bmms = [e[1][:2] if e[0] == "aten.bmm.default" else e[1][1:3] for e in seq if e[0] in _BATCHED_PRODUCTS]
        q, kt = bmms[0]
        heads, head_dim = q[0] // batch, q[-1]
        v_dim = bmms[1][1][-1] if len(bmms) > 1 else head_dim
        kv_heads_core = heads
        core = "eager"
    projs = pat.projections_under(inv, rec.path)
    latent = [p for p in projs if p.in_features not in (width, heads * v_dim) and p.out_features > p.in_features]
    mla = bool(latent)
    # projections from the width that make whole heads: a router beside them (queries kept as experts) makes none
    from_hidden = [p.out_features for p in projs if p.in_features == width and p.out_features % head_dim == 0]
    if mla:
        kv_heads = heads
    elif len(from_hidden) >= 3:
        named = named_kv_heads([module], heads, head_dim, from_hidden) if module is not None else None
        kv_heads = named or min(kv_heads_core, min(from_hidden) // head_dim) or heads
    elif from_hidden:  # the widest holds k and v fused, with q or without; the other one is q or the output
        units = max(from_hidden) // head_dim
        kv_heads = max(1, (units - heads) // 2 if units > heads else units // 2)
    else:
        kv_heads = heads
    variant: dict[str, Any] = {
        "core": core,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "v_head_dim": v_dim,
        "layout": "mqa" if kv_heads == 1 and heads > 1 else ("gqa" if kv_heads < heads else "mha"),
        "mla": mla,
        "softcap": _softcap(seq),
        "sinks": _sinks(rec, heads, seq),
        "qk_norm": (not mla)
        and any(
            inv.modules[c].params and pat.is_norm_candidate(inv.modules[c]) for c in rec.children if c in inv.modules
        ),
        "rope": _rope_style(seq, head_dim, mla),
    }
    if mla:
        variant["latent_projections"] = [p.path for p in latent]
    return variant


def _softcap(seq: list[list[Any]]) -> float | None:
    """tanh between the QK^T product and the softmax, wrapped in div/mul by the same constant."""
    names = [e[0] for e in seq]
    soft = next((i for i, n in enumerate(names) if n in pat.SOFTMAX_OPS), None)
    first_mm = next((i for i, n in enumerate(names) if n in pat.MATMUL_OPS[2:]), None)
    if soft is None or first_mm is None:
        return None
    for i in range(first_mm, soft):
        if names[i] == "aten.tanh.default":
            return tanh_cap(seq, i)
    return None


def tanh_cap(seq: list[list[Any]], i: int) -> float | None:
    """The constant c of c * tanh(x / c) around the tanh at ``seq[i]``."""

    def scalar(step: int) -> float | None:
        j = i + step
        while 0 <= j < len(seq) and seq[j][0] in ("aten.detach.default", "aten.alias.default"):
            j += step
        values = [a for a in seq[j][2] if isinstance(a, float)] if 0 <= j < len(seq) else []
        return values[0] if values else None

    before, after = scalar(-1), scalar(+1)
    return after if before is not None and after is not None and abs(before - after) <= 1e-9 * abs(after) else None


def _sinks(rec: ModuleRecord, heads: int, seq: list[list[Any]]) -> bool:
    """Learned per-head logits concatenated to the scores right before the softmax."""
    names = [e[0] for e in seq]
    soft = next((i for i, n in enumerate(names) if n in pat.SOFTMAX_OPS), None)
    has_head_param = any(len(s) == 1 and s[0] == heads for s in rec.params.values())
    return bool(has_head_param and soft and "aten.cat.default" in names[max(0, soft - 4) : soft])


def _rope_style(seq: list[list[Any]], head_dim: int, mla: bool) -> dict[str, Any] | None:
    """Interleaved pairs (stride-2 slices) or half rotation (neg of the upper half + cat); rotary dim
    from the rotated tensor.  MLA with a rotary part narrower than the head is DeepSeek's decoupled rope."""
    strided = [e for e in seq if e[0] == "aten.slice.Tensor" and len(e[2]) >= 4 and e[2][3] == 2]
    negs = [e for e in seq if e[0] == "aten.neg.default"]
    if strided:
        style, rotary_dim = "interleaved", strided[0][1][0][-1]
    elif negs:
        style, rotary_dim = "half", 2 * negs[0][1][0][-1]
    else:
        return None
    return {
        "style": style,
        "rotary_dim": rotary_dim,
        "partial": rotary_dim < head_dim,
        "decoupled": mla and rotary_dim < head_dim,
    }
