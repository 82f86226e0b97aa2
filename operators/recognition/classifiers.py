"""Per-module classification: the candidate kind ``patterns`` reads from a module's trace, confirmed by that kind's
probe and recorded with the variant a kernel needs."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from torch import nn

from adapt.model.blocks import is_expert_list
from operators.inventory import ModuleRecord, OpInventory
from operators.recognition import patterns as pat
from operators.recognition import variants
from operators.recognition.attention import classify_attention, rotary_application
from operators.recognition.component import Component
from operators.recognition.mlp_probe import probe_mlp
from operators.recognition.moe import probe_moe, probe_routed_experts, routing_from_sequence
from operators.recognition.norm_probe import probe_norm
from operators.recognition.probe_cache import ProbeCache, structure_key
from operators.recognition.rotary_probes import probe_rotary_tables
from operators.recognition.split_halves import classify_split_half, split_half_candidate


def classify(
    module: nn.Module, rec: ModuleRecord, inventory: OpInventory, generator, can_probe: bool, cache: ProbeCache, reject
) -> tuple[Component | None, list[Component]]:
    """The component ``rec`` is (or None) and the components found with it (the rotary application)."""
    width = pat.last_dim(rec.input_shapes)
    if pat.is_moe_candidate(inventory, rec):
        comp = _moe(module, rec, inventory, generator, can_probe, cache)
    elif _expert_list(module) is not None and pat.is_routed(inventory, rec, _expert_count(module)):
        comp = _moe(module, rec, inventory, generator, can_probe, cache, _expert_list(module))
    elif (call := pat.routed_experts_call(rec)) is not None:
        comp = _routed_experts(module, rec, inventory, generator, can_probe, cache, reject, *call)
    elif pat.is_attention_candidate(inventory, rec):
        comp = classify_attention(module, rec, inventory, generator, can_probe, cache)
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
    elif (half := split_half_candidate(inventory, rec)) is not None:
        comp = classify_split_half(half, module, rec, inventory, generator, can_probe, cache, reject)
    elif pat.is_norm_candidate(rec):
        comp = _norm(module, rec, inventory, generator, can_probe, reject, cache)
    elif pat.rotary_generator(rec):
        comp = _rotary(module, rec, inventory, can_probe)
    elif pat.is_activation_only(rec):
        comp = Component(
            rec.path,
            "activation",
            variants.ActivationVariant(op=pat.compute_ops(rec)[0]),
            True,
            "a single elementwise ATen activation",
        )
    elif "aten.embedding.default" in rec.own_ops:
        extra_ops = tuple(pat.compute_ops(rec))
        comp = Component(
            rec.path, "embedding", variants.EmbeddingVariant(extra_ops=extra_ops), True, "aten.embedding lookup"
        )
    else:
        comp = None
    extra = []
    if comp is not None and comp.kind == "attention" and can_probe and rec.path in inventory.captured:
        rotation = rotary_application(module, rec.path, inventory, generator, cache)
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


def _routed_experts(module, rec, inventory, generator, can_probe: bool, cache, reject, width: int, top_k: int):
    """Expert banks called with their block's routing, confirmed by ``probe_routed_experts``."""
    if not can_probe:
        return Component(rec.path, "routed_experts", variants.RoutedExpertsVariant(width=width, top_k=top_k), False,
                         "pattern only (meta tensors)")  # fmt: skip
    run = functools.partial(probe_routed_experts, module, rec.path, width, top_k, rec.scalars, generator)
    measured, suffix = cache.verdict(("routed_experts", *structure_key(module, rec, inventory)), rec.path, run)
    if measured is None:
        reject(rec.path, "routed_experts", "no weighted sum of gated experts over its banks matched")
        return None
    return _measured(rec.path, measured, "float64 match of the weighted gated experts for fresh indices" + suffix)


def _measured(path: str, measured: dict[str, Any], evidence: str, **recorded: Any) -> Component:
    """The confirmed component a probe's result describes: its ``kind`` and fields, with what recognition
    recorded beside the probe (``recorded`` wins over a probed field of the same name)."""
    fields = {k: v for k, v in measured.items() if k != "kind"}
    return Component(
        path, measured["kind"], variants.VARIANTS[measured["kind"]](**{**fields, **recorded}), True, evidence
    )


def candidate_name(inventory: OpInventory, rec: ModuleRecord) -> str:
    """The kind ``rec`` looks like, named in its rejection when its probe could not run the module."""
    if pat.is_moe_candidate(inventory, rec) or "aten.topk.default" in rec.own_ops:
        return "moe"
    if pat.is_attention_candidate(inventory, rec):
        return "attention"
    if pat.is_mlp_candidate(inventory, rec):
        return "mlp"
    return split_half_candidate(inventory, rec) or ("norm" if pat.is_norm_candidate(rec) else "component")


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
        rows_per_token=_rows_per_token(rec, inv),
        already_fused=any("layer_norm" in op or "rms_norm" in op for op in rec.own_ops),
    )


def _rows_per_token(rec: ModuleRecord, inv: OpInventory) -> int:
    """Rows of its last dimension the module's first input holds per token of the traced model input."""
    tokens, width = math.prod(inv.input_shape or [1]), pat.last_dim(rec.input_shapes)
    elements = math.prod(rec.input_shapes[0]) if rec.input_shapes else 0
    return max(1, elements // (tokens * width)) if tokens and width else 1


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
    bank = [] if expert_list else pat.expert_weights(inv, rec.path, pat.router_rows(inv, router))
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
