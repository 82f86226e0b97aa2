"""Mixture-of-experts confirmation: the module against a generic float64 MoE reference.

The reference is written once for every routed MoE: router matrix -> softmax or sigmoid scores ->
optional selection bias -> optional group-limited top-k -> top-k -> optional renormalisation and
scaling -> weighted sum of gated-MLP experts from a [E, out, in] weight bank -> plus shared experts.
The free choices (activation, gate/up order, renormalisation, scale) are searched; the structural
ones (k, groups, scoring) are read from the trace.  Only an exact float64 match confirms.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from operators.recognition.probes import ACTIVATIONS, close, float64_copy


@dataclass
class Routing:
    scoring: str  # "softmax" | "sigmoid"
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"  # "max" or "top2_sum"


def routing_from_sequence(sequence: list[list[Any]], ops: dict[str, int]) -> Routing | None:
    """Read k, groups and scoring from the router's traced op sequence."""
    topks = [entry for entry in sequence if entry[0] == "aten.topk.default"]
    if not topks:
        return None
    scoring = "sigmoid" if "aten.sigmoid.default" in ops else "softmax"
    ks = [int(entry[2][0]) for entry in topks]
    if len(topks) >= 3:
        groups = int(topks[0][1][0][-2])
        return Routing(scoring, ks[-1], groups, ks[1], "top2_sum" if ks[0] == 2 else "max")
    return Routing(scoring, ks[-1])


def route(x2d, router_w, router_b, correction, routing: Routing):
    logits = x2d @ router_w.t()
    if router_b is not None:
        logits = logits + router_b
    scores = torch.sigmoid(logits) if routing.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if correction is None else scores + correction
    if routing.n_group > 1:
        grouped = choice.view(x2d.shape[0], routing.n_group, -1)
        per_group = grouped.topk(2, dim=-1).values.sum(-1) if routing.group_score == "top2_sum" else grouped.amax(-1)
        keep = torch.zeros_like(per_group).scatter_(1, per_group.topk(routing.topk_group, dim=-1).indices, 1.0)
        mask = keep.unsqueeze(-1).expand_as(grouped).reshape(x2d.shape[0], -1)
        choice = choice.masked_fill(mask == 0, 0.0)
    index = choice.topk(routing.top_k, dim=-1).indices
    return scores.gather(1, index), index


def probe_moe(
    module: nn.Module,
    path: str,
    width: int,
    routing: Routing,
    router: tuple[str, str],
    bank: list[tuple[str, str, list[int]]],
    shared: str | None,
    scalars: list[float],
    generator,
) -> dict[str, Any] | None:
    """Confirm a routed MoE; returns its variant parameters or None."""
    # Grouped-GEMM expert kernels have no float64 path: run the module in float32 and the reference in
    # float64 from the very same (float32-representable) weights.
    m = float64_copy(module, generator, scale=0.3).float()
    rel = lambda p: p[len(path) + 1 :]  # noqa: E731
    router_mod = m.get_submodule(rel(router[0])) if router[0] != path else m
    router_w = getattr(router_mod, router[1]).detach().double()
    num_experts = router_w.shape[0]
    router_b = next((p.detach().double() for p in router_mod.parameters(recurse=False) if p.dim() == 1 and p.shape[0] == num_experts), None)
    correction = next((b.double() for b in router_mod.buffers(recurse=False) if b.dim() == 1 and b.shape[0] == num_experts), None)
    banks = [getattr(m.get_submodule(rel(mod)) if mod != path else m, name).detach().double() for mod, name, _ in bank]
    experts = _expert_layouts(banks, width, num_experts)
    if not experts:
        return None
    shared_mod = m.get_submodule(rel(shared)) if shared else None
    x = torch.randn(2, 6, width, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        out = m(x.float())
        out = (out[0] if isinstance(out, tuple) else out).double()
        x2d = x.reshape(-1, width)
        weights, index = route(x2d, router_w, router_b, correction, routing)
        shared_out = shared_mod.double()(x).reshape(-1, width) if shared_mod is not None else None
        scales = sorted({1.0, *(s for s in scalars if 0.0 < s <= 64.0 and s != 1.0)})
        for (layout, gate_first), (act_name, act), normalize in itertools.product(experts, ACTIVATIONS.items(), (True, False)):
            routed = _run_experts(x2d, weights, index, layout, gate_first, act, normalize)
            for scale, with_shared in itertools.product(scales, (shared_out is not None, False)):
                ref = routed * scale + (shared_out if with_shared else 0.0)
                if close(out.reshape(-1, width), ref):
                    return {
                        "kind": "moe",
                        "num_experts": num_experts,
                        "scoring": routing.scoring,
                        "top_k": routing.top_k,
                        "n_group": routing.n_group,
                        "topk_group": routing.topk_group,
                        "group_score": routing.group_score,
                        "selection_bias": correction is not None,
                        "normalize_topk": normalize,
                        "routed_scale": scale,
                        "activation": act_name,
                        "shared_experts": shared if with_shared else None,
                        "router": router[0],
                        "expert_width": layout[2],
                    }
    return None


def _expert_layouts(banks: list[torch.Tensor], width: int, num_experts: int):
    """Possible (w_gate_up, w_down, inner) readings of the 3-D expert weights, as [E, out, in] views."""
    banks = [b for b in banks if b.shape[0] == num_experts]
    if len(banks) != 2:
        return []
    layouts = []
    for up, down in itertools.permutations(banks, 2):
        up_v = up if up.shape[2] == width else up.transpose(1, 2)
        down_v = down if down.shape[1] == width else down.transpose(1, 2)
        if up_v.shape[2] != width or down_v.shape[1] != width or up_v.shape[1] != 2 * down_v.shape[2]:
            continue
        for gate_first in (True, False):
            layouts.append(((up_v, down_v, down_v.shape[2]), gate_first))
    return layouts


def _run_experts(x2d, weights, index, layout, gate_first, act, normalize):
    up, down, _ = layout
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    out = torch.zeros_like(x2d)
    for slot in range(index.shape[1]):
        for expert in index[:, slot].unique().tolist():
            rows = (index[:, slot] == expert).nonzero().squeeze(-1)
            h = x2d[rows] @ up[expert].t()
            a, b = h.chunk(2, dim=-1)
            gate, lin = (a, b) if gate_first else (b, a)
            y = (act(gate) * lin) @ down[expert].t()
            out[rows] += weights[rows, slot : slot + 1] * y
    return out
