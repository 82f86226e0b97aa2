"""Structural recognition: candidate kind from the traced subgraph, confirmed by a numeric probe.

``recognise(model, inventory)`` walks every traced module, asks ``patterns`` for a candidate kind
and runs the matching probe from ``probes``/``moe`` on fresh random data.  Confirmed components
carry the variant parameters a kernel needs (eps, offset, cast order, activation, window, softcap,
routing) and the attribute names found during recognition, so the patcher can call a kernel with
the module's own parameters; each kind's variant is its dataclass in ``variants``.  Modules that
compute something but match no kind are reported as ``new``; they run through decomposition or a
generated kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from adapt.model.blocks import NoBlockList, find_blocks, is_expert_list
from operators.inventory import ModuleRecord, OpInventory
from operators.recognition import patterns as pat
from operators.recognition import variants
from operators.recognition.component import Component
from operators.recognition.moe import probe_moe, routing_from_sequence
from operators.recognition.probe_cache import ProbeCache, structure_key
from operators.recognition.probes import (
    attention_core_matches,
    attention_visibility,
    probe_lm_head_loss,
    probe_mlp,
    probe_norm,
    probe_rotary_application,
    probe_rotary_tables,
)

KINDS = (
    "rms_norm",
    "layer_norm",
    "gated_mlp",
    "mlp",
    "attention",
    "rotary",
    "rotary_application",
    "moe",
    "residual_add_norm",
    "lm_head_cross_entropy",
    "embedding",
    "activation",
)

# Ops that move or view data, or are pure bookkeeping: a module made only of these computes nothing new.
_STRUCTURAL_OPS = {
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.transpose.int",
    "aten.t.default",
    "aten.permute.default",
    "aten.expand.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.slice.Tensor",
    "aten.clone.default",
    "aten.detach.default",
    "aten.alias.default",
    "aten.lift_fresh.default",
    "aten._to_copy.default",
    "aten.contiguous.default",
    "aten.select.int",
    "aten.split.Tensor",
    "aten.split_with_sizes.default",
    "aten.embedding.default",
    "aten.mm.default",
    "aten.addmm.default",
    "aten.native_dropout.default",
}


# Components whose children stay separately recognisable (q/k norms, MLA latent norms, shared experts).
_OPEN_KINDS = ("attention", "moe")

_ACTIVATION_OPS = {
    "aten.gelu.default",
    "aten.silu.default",
    "aten.relu.default",
    "aten.tanh.default",
    "aten.sigmoid.default",
    "aten.hardtanh.default",
    "aten.elu.default",
    "aten.leaky_relu.default",
    "aten.mish.default",
}


@dataclass
class Recognition:
    components: list[Component]
    rejected: list[dict[str, str]]  # candidates whose probe failed: module, candidate, reason

    def by_kind(self, kind: str) -> list[Component]:
        return [c for c in self.components if c.kind == kind]

    def to_dict(self) -> dict[str, Any]:
        return {"components": [c.to_dict() for c in self.components], "rejected": self.rejected}


def recognise(
    model: nn.Module, inventory: OpInventory, *, seed: int = 0, probe: bool = True, cache: ProbeCache | None = None
) -> Recognition:
    """Recognise every component of ``model`` from ``inventory`` (traced with ``capture=True``).

    With ``probe=False`` (meta-device models) candidates are reported unconfirmed.  Norm, MLP and
    attention probes run once per distinct structure (``probe_cache``); pass ``cache`` to see how many ran.
    """
    generator = torch.Generator().manual_seed(seed)
    can_probe = probe and inventory.device != "meta"
    found: list[Component] = []
    rejected: list[dict[str, str]] = []
    claimed: set[str] = set()  # modules inside an accepted component

    def accept(comp: Component) -> None:
        found.append(comp)
        if comp.kind not in _OPEN_KINDS:
            claimed.add(comp.module)

    def reject(path: str, candidate: str, reason: str) -> None:
        rejected.append({"module": path, "candidate": candidate, "reason": reason})

    cache = cache if cache is not None else ProbeCache()
    records = sorted(inventory.modules.values(), key=lambda r: r.path.count("."))  # outermost first
    for rec in records:
        if not rec.path or _inside(rec.path, claimed, strict=True):
            continue
        module = model.get_submodule(rec.path)
        try:
            comp, extra = _classify(module, rec, inventory, generator, can_probe, cache, reject)
        except Exception as err:  # noqa: BLE001 - a probe that cannot call the module rejects it, never the stage
            reject(
                rec.path,
                _candidate_name(inventory, rec),
                f"probe could not run the module: {type(err).__name__}: {str(err)[:200]}",
            )
            continue
        if comp is not None:
            accept(comp)
            found.extend(extra)
            if isinstance(comp.variant, variants.MoEVariant) and comp.variant.experts:
                claimed.add(comp.variant.experts)  # experts kept as a list belong to their MoE, not each its own MLP
    found.extend(_residual_norms(inventory, found))
    head = _lm_head(model, inventory, generator, can_probe)
    if head is not None:
        found.append(head)
    found.extend(_new_modules(inventory, found, _block_paths(model)))
    return Recognition(sorted(found, key=lambda c: c.module), rejected)


def _classify(
    module: nn.Module, rec: ModuleRecord, inventory: OpInventory, generator, can_probe: bool, cache: ProbeCache, reject
) -> tuple[Component | None, list[Component]]:
    """The component ``rec`` is (or None) and the components found with it (the rotary application)."""
    width = pat.last_dim(rec.input_shapes)
    if pat.is_moe_candidate(inventory, rec):
        comp = _moe(module, rec, inventory, generator, can_probe, cache)
    elif _expert_list(module) is not None and pat.is_routed(inventory, rec, _expert_count(module)):
        comp = _moe(module, rec, inventory, generator, can_probe, cache, _expert_list(module))
    elif pat.is_attention_candidate(inventory, rec):
        comp = _attention(module, rec, inventory, generator, can_probe, cache)
    elif pat.is_mlp_candidate(inventory, rec):
        variant, evidence = None, "float64 output+grad match"
        if can_probe:
            projections = pat.projections_under(inventory, rec.path)
            run = functools.partial(probe_mlp, module, rec.path, width, projections, generator)
            variant, suffix = cache.verdict(structure_key(module, rec, inventory), rec.path, run)
            evidence += suffix
        comp = _measured(rec.path, variant, evidence, width=width) if variant else None
        if comp is None and can_probe:
            reject(rec.path, "mlp", "no gated/plain MLP composition of its projections matched")
        elif comp is None:
            comp = Component(rec.path, "mlp", variants.MLPVariant(), False, "pattern only (meta tensors)")
    elif pat.is_norm_candidate(rec):
        comp = _norm(module, rec, inventory, generator, can_probe, reject, cache)
    elif pat.rotary_generator(rec):
        comp = _rotary(module, rec, inventory, can_probe)
    elif _activation_only(rec):
        comp = Component(
            rec.path,
            "activation",
            variants.ActivationVariant(op=_compute_ops(rec)[0]),
            True,
            "a single elementwise ATen activation",
        )
    elif "aten.embedding.default" in rec.own_ops:
        extra_ops = tuple(_compute_ops(rec))
        comp = Component(
            rec.path, "embedding", variants.EmbeddingVariant(extra_ops=extra_ops), True, "aten.embedding lookup"
        )
    else:
        comp = None
    extra = []
    if comp is not None and comp.kind == "attention" and can_probe and rec.path in inventory.captured:
        rotation = _rotary_application(module, rec.path, inventory, generator, cache)
        if comp.variant.rope:
            extra.append(rotation)
        elif (
            rotation.confirmed
        ):  # rotary written without a telltale op (no neg, no stride-2 slice): found by its numbers
            extra.append(rotation)
            dim, head = rotation.variant.rotary_dim, rotation.variant.head_dim
            rope = variants.RopeStyle(style=rotation.variant.style, rotary_dim=dim, partial=dim < head, decoupled=False)
            comp.variant = dataclasses.replace(comp.variant, rope=rope)
    return comp, extra


def _measured(path: str, measured: dict[str, Any], evidence: str, **recorded: Any) -> Component:
    """The confirmed component a probe's result describes: its ``kind`` and fields, with what recognition
    recorded beside the probe (``recorded`` wins over a probed field of the same name)."""
    fields = {k: v for k, v in measured.items() if k != "kind"}
    return Component(
        path, measured["kind"], variants.VARIANTS[measured["kind"]](**{**fields, **recorded}), True, evidence
    )


def _candidate_name(inventory: OpInventory, rec: ModuleRecord) -> str:
    if pat.is_moe_candidate(inventory, rec) or "aten.topk.default" in rec.own_ops:
        return "moe"
    if pat.is_attention_candidate(inventory, rec):
        return "attention"
    if pat.is_mlp_candidate(inventory, rec):
        return "mlp"
    return "norm" if pat.is_norm_candidate(rec) else "component"


def _compute_ops(rec: ModuleRecord) -> list[str]:
    return sorted(op for op in rec.own_ops if op not in _STRUCTURAL_OPS)


def _activation_only(rec: ModuleRecord) -> bool:
    ops = _compute_ops(rec)
    return not rec.children and not rec.params and len(ops) == 1 and ops[0] in _ACTIVATION_OPS


def _inside(path: str, claimed: set[str], *, strict: bool) -> bool:
    return any(path.startswith(c + ".") or (not strict and path == c) for c in claimed if c)


def _norm(
    module, rec: ModuleRecord, inv: OpInventory, generator, can_probe: bool, reject, cache: ProbeCache
) -> Component | None:
    if len(rec.input_shapes) > 1:  # a gated norm, norm(x, gate): the norm kernels take x alone
        reject(rec.path, "norm", f"called with {len(rec.input_shapes)} tensor inputs; a norm kernel takes one")
        return None
    if any("layer_norm" in op for op in rec.own_ops) and not can_probe:
        return Component(rec.path, "layer_norm", variants.LayerNormVariant(), False, "pattern only (meta tensors)")
    if not can_probe:
        return Component(rec.path, "rms_norm", variants.RMSNormVariant(), False, "pattern only (meta tensors)")
    run = functools.partial(probe_norm, module, pat.last_dim(rec.input_shapes), rec.scalars, generator)
    variant, suffix = cache.verdict(structure_key(module, rec, inv), rec.path, run)
    if variant is None:
        reject(rec.path, "norm", "matches neither RMSNorm (offset 0/1) nor LayerNorm in float64" + suffix)
        return None
    return _measured(
        rec.path,
        variant,
        "float64 output+grad match at three magnitudes" + suffix,
        width=pat.last_dim(rec.input_shapes),
        already_fused=any("layer_norm" in op or "rms_norm" in op for op in rec.own_ops),
    )


def _rotary(module, rec: ModuleRecord, inv: OpInventory, can_probe: bool) -> Component | None:
    if not can_probe or rec.path not in inv.captured:
        return Component(
            rec.path, "rotary", variants.RotaryVariant(rotary_dim=rec.output_shapes[0][-1]), False, "pattern only"
        )
    args, kwargs = inv.captured[rec.path]
    variant = probe_rotary_tables(module, args, kwargs)
    if variant is None:
        return None
    return _measured(rec.path, variant, "cos^2+sin^2 constant, layout from table symmetry")


def _rotary_application(module, path: str, inv: OpInventory, generator, cache: ProbeCache) -> Component:
    """The global function the attention forward rotates (q, k) with, probed once per distinct structure;
    unconfirmed (no kernel offered) with the reason when none is found."""
    key = ("rotary_application", *structure_key(module, inv.modules[path], inv, call_inputs=True))
    run = functools.partial(probe_rotary_application, module, *inv.captured[path], generator)
    (variant, evidence), suffix = cache.verdict(key, path, run)
    fields = {("global_name" if k == "global" else k): v for k, v in (variant or {}).items()}
    return Component(
        path, "rotary_application", variants.RotaryApplicationVariant(**fields), variant is not None, evidence + suffix
    )


def _attention(module, rec: ModuleRecord, inv: OpInventory, generator, can_probe: bool, cache: ProbeCache) -> Component:
    variant = attention_shape(inv, rec)
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


def attention_shape(inv: OpInventory, rec: ModuleRecord) -> dict[str, Any]:
    """Heads, head dims, core, soft-capping, sinks, rotary style and MLA from the traced sequence."""
    seq = rec.sequence
    width = pat.last_dim(rec.input_shapes)
    batch = rec.input_shapes[0][0]
    sdpa = next((e for e in seq if e[0].startswith(pat.SDPA_PREFIX)), None)
    if sdpa is not None:
        q, k, v = sdpa[1][:3]
        heads, head_dim, kv_heads_core, v_dim = q[1], q[-1], k[1], v[-1]
        core = "sdpa"
    else:
        bmms = [e for e in seq if e[0] == "aten.bmm.default"]
        q, kt = bmms[0][1][:2]
        heads, head_dim = q[0] // batch, q[-1]
        v_dim = bmms[1][1][1][-1] if len(bmms) > 1 else head_dim
        kv_heads_core = heads
        core = "eager"
    projs = pat.projections_under(inv, rec.path)
    latent = [p for p in projs if p.in_features not in (width, heads * v_dim) and p.out_features > p.in_features]
    mla = bool(latent)
    from_hidden = [p.out_features for p in projs if p.in_features == width]
    if mla:
        kv_heads = heads
    elif len(from_hidden) >= 3:
        kv_heads = min(kv_heads_core, min(from_hidden) // head_dim) or heads
    elif len(from_hidden) == 1 and from_hidden[0] % head_dim == 0:
        kv_heads = max(1, (from_hidden[0] // head_dim - heads) // 2)
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
            return _tanh_cap(seq, i)
    return None


def _tanh_cap(seq: list[list[Any]], i: int) -> float | None:
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


def _expert_list(module: nn.Module) -> str | None:
    """Path (below ``module``) of experts kept as a list of separate modules, if any."""
    return next((path for path, sub in module.named_modules() if path and is_expert_list(sub)), None)


def _expert_count(module: nn.Module) -> int:
    path = _expert_list(module)
    return len(module.get_submodule(path)) if path is not None else 0


def _moe(
    module,
    rec: ModuleRecord,
    inv: OpInventory,
    generator,
    can_probe: bool,
    cache: ProbeCache,
    expert_list: str | None = None,
) -> Component:
    router = pat.router_of(inv, rec, _expert_count(module) if expert_list else None)
    router_rec = inv.modules[router[0]]
    routing = routing_from_sequence(router_rec.sequence or rec.sequence, router_rec.ops)
    if routing is None:  # the top-k runs in the MoE module itself, after a plain router projection
        routing = routing_from_sequence(rec.sequence, rec.own_ops)
    bank = pat.expert_weights(inv, rec.path)
    experts_at = f"{rec.path}.{expert_list}" if expert_list else None
    shared = next((c for c in rec.children if c in inv.modules and pat.is_mlp_candidate(inv, inv.modules[c])
                   and not (experts_at and c.startswith(experts_at + "."))), None)  # fmt: skip
    base = {
        "scoring": routing.scoring,
        "top_k": routing.top_k,
        "n_group": routing.n_group,
        "topk_group": routing.topk_group,
        "num_experts": len(module.get_submodule(expert_list)) if expert_list else (bank[0][2][0] if bank else 0),
        "shared_experts": shared,
        "router": router[0],
        "width": pat.last_dim(rec.input_shapes),
        "expert_container": "module_list" if expert_list else "bank",
        "experts": experts_at,
    }
    if not can_probe:
        return Component(rec.path, "moe", variants.MoEVariant(**base), False, "pattern only (meta tensors)")
    run = functools.partial(
        probe_moe,
        module,
        rec.path,
        pat.last_dim(rec.input_shapes),
        routing,
        router,
        bank,
        shared,
        rec.scalars,
        generator,
        expert_list,
    )
    variant, suffix = cache.verdict(("moe", expert_list, *structure_key(module, rec, inv)), rec.path, run)
    if variant is None:
        return Component(
            rec.path,
            "moe",
            variants.MoEVariant(**base),
            False,
            "routing pattern found, float64 reference did not match" + suffix,
        )
    recorded = {"width": base["width"], "expert_container": base["expert_container"], "experts": experts_at}
    if expert_list:  # no bank to hand a grouped kernel: the experts run as the model wrote them
        recorded.update(gate_up_layout="module_list", down_layout="module_list")
    return _measured(rec.path, variant, "float64 match against the generic routed-MoE reference" + suffix, **recorded)


def _residual_norms(inv: OpInventory, found: list[Component]) -> list[Component]:
    """Norms whose input is the output of an ``aten.add`` run by the enclosing block: fusable add+norm."""
    out = []
    for comp in found:
        if comp.kind in ("rms_norm", "layer_norm") and comp.confirmed:
            rec = inv.modules[comp.module]
            if rec.fed_by_add is not None and (rec.fed_by_add == "" or comp.module.startswith(rec.fed_by_add + ".")):
                variant = variants.ResidualAddNormVariant(
                    norm=comp.kind,
                    add_in=rec.fed_by_add,
                    add_after=rec.fed_by_add_after,
                    add_index=rec.fed_by_add_index,
                    **dataclasses.asdict(comp.variant),
                )
                out.append(
                    Component(
                        comp.module,
                        "residual_add_norm",
                        variant,
                        True,
                        "norm input is the tensor an aten.add of an enclosing block produced",
                    )
                )
    return out


def _lm_head(model: nn.Module, inv: OpInventory, generator, can_probe: bool) -> Component | None:
    head = pat.lm_head_candidate(inv)
    if head is None:
        return None
    root = inv.modules[""]
    names = [e[0] for e in root.sequence]
    softcap = _tanh_cap(root.sequence, names.index("aten.tanh.default")) if "aten.tanh.default" in names else None
    variant = variants.HeadLossVariant(vocab=head.out_features, hidden=head.in_features, final_softcap=softcap)
    confirmed, evidence = (
        probe_lm_head_loss(model, head.path, softcap, generator) if can_probe else (False, "pattern only")
    )
    return Component(
        head.path,
        "lm_head_cross_entropy",
        variant,
        confirmed,
        f"projection onto the vocabulary feeds log_softmax + nll_loss; {evidence}",
    )


def _block_paths(model: nn.Module) -> set[str]:
    try:
        return {path for path, _ in find_blocks(model).named()}
    except NoBlockList:
        return set()


_RESIDUAL_OPS = {"aten.add.Tensor", "aten.add_.Tensor"}


def _new_modules(inv: OpInventory, found: list[Component], blocks: set[str]) -> list[Component]:
    """Modules that compute (non-structural own ops) but sit in no recognised component: leaves, and
    containers inside a block whose own code does more than add residuals (a gate, a recurrence)."""
    covered = {c.module for c in found}
    out = []
    for rec in inv.modules.values():
        if not rec.path or rec.path in covered or _inside(rec.path, covered, strict=True):
            continue
        if any(rec.path.startswith(c.module + ".") for c in found):
            continue
        compute = _compute_ops(rec)
        in_block = rec.path not in blocks and any(rec.path.startswith(b + ".") for b in blocks)
        if compute and (not rec.children or (in_block and set(compute) - _RESIDUAL_OPS)):
            variant = variants.NewVariant(ops=tuple(compute), container=bool(rec.children))
            out.append(Component(rec.path, "new", variant, False, "computes, matches no known kind"))
    return out
