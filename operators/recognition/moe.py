"""Mixture-of-experts confirmation: the module against a generic float64 MoE reference.

The reference is written once for every routed MoE: router matrix -> softmax or sigmoid scores ->
optional selection bias -> optional group-limited top-k -> top-k -> optional renormalisation and
scaling -> weighted sum of gated-MLP experts from a [E, out, in] weight bank -> plus shared experts and
the module's own output bias.  The free choices (activation, gate/up order, renormalisation, scale, which
additions) are searched; the structural ones (k, groups, scoring) are read from the trace.  Only an exact
float64 match confirms.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from adapt.model.activations import ACTIVATIONS
from operators.recognition.component import dotted_attr
from operators.recognition.probes import close, float32_sum_tolerance, redrawn_copy


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
    expert_list: str | None = None,
) -> dict[str, Any] | None:
    """Confirm a routed MoE; returns its variant parameters or None.

    ``expert_list``: the experts are a list of separate gated MLPs at this path (relative to the module);
    their weights are stacked into banks for the reference."""
    # Grouped-GEMM expert kernels have no float64 path: run the module in float32 and the reference in
    # float64 from the very same weights (widened expert by expert as the reference reaches them).
    m = redrawn_copy(module, generator, scale=0.3, dtype=torch.float32)
    rel = lambda p: p[len(path) + 1 :]  # noqa: E731
    router_mod = m.get_submodule(rel(router[0])) if router[0] != path else m
    router_w = dotted_attr(router_mod, router[1]).detach().double()
    num_experts = router_w.shape[0]
    # the weight may sit on a child projection of the router ("layer.weight"): its bias sits beside it
    owner_name = router[1].rpartition(".")[0]
    owners = [(owner_name, router_mod.get_submodule(owner_name))] + ([("", router_mod)] if owner_name else [])
    router_b_name, router_b = _per_expert_vector(_named(owners, "named_parameters"), num_experts)
    correction_name, correction = _per_expert_vector(_named(owners, "named_buffers"), num_experts)
    router_b = router_b.detach().double() if router_b is not None else None
    correction = correction.double() if correction is not None else None
    bank_rows = False  # the banks are 2-D matrices with the experts stacked in their rows
    if expert_list is not None:
        names, banks = stacked_banks(m.get_submodule(expert_list), width, expert_list)
    else:
        names = [f"{mod}.{name}" for mod, name, _ in bank]
        stored = [getattr(m.get_submodule(rel(mod)) if mod != path else m, name).detach() for mod, name, _ in bank]
        banks = [b.view(shape) for b, (_, _, shape) in zip(stored, bank)]  # row-stacked 2-D banks as [E, rows, width]
        bank_rows = any(b.dim() == 2 for b in stored)
    experts = _expert_layouts(banks, names, width, num_experts)
    if not experts:
        return None
    shared_mod = m.get_submodule(rel(shared)) if shared else None
    bias_name, output_bias = _output_bias(m, width, router_b_name if router_mod is m else None)
    x = torch.randn(2, 6, width, generator=generator, dtype=torch.float64)
    stochastic = _stochastic_in_training(m, x.float())
    with torch.no_grad():
        full = m(x.float())
        out = (full[0] if isinstance(full, tuple) else full).double()
        x2d = x.reshape(-1, width)
        logits = x2d @ router_w.t() + (router_b if router_b is not None else 0.0)
        outputs = _output_structure(full, logits)
        logits_output = _logits_output(router_mod, x2d.float(), logits) if router_mod is not m else None
        weights, index = route(x2d, router_w, router_b, correction, routing)
        used, index = index.unique(return_inverse=True)  # the reference widens only the experts tokens reach
        widened: dict[int, torch.Tensor] = {}

        def wide(bank: torch.Tensor) -> torch.Tensor:
            if id(bank) not in widened:
                widened[id(bank)] = bank[used].double()
            return widened[id(bank)]

        shared_out = shared_mod.double()(x).reshape(-1, width) if shared_mod is not None else None
        scales = sorted({1.0, *(s for s in scalars if 0.0 < s <= 64.0 and s != 1.0)})
        atol = float32_sum_tolerance(width + experts[0][0][2])
        for (layout, gate_first, where), (act_name, act), normalize in itertools.product(
            experts, ACTIVATIONS.items(), (True, False)
        ):
            up, down, inner = layout
            routed = _run_experts(x2d, weights, index, (wide(up), wide(down), inner), gate_first, act, normalize)
            for scale, with_shared, with_bias in itertools.product(
                scales, (shared_out is not None, False), (output_bias is not None, False)
            ):
                ref = routed * scale + (shared_out if with_shared else 0.0) + (output_bias if with_bias else 0.0)
                if close(out.reshape(-1, width), ref, atol=atol):
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
                        "output_bias": bias_name if with_bias else None,
                        "router": router[0],
                        "expert_width": layout[2],
                        # where the patched forward finds each tensor (parameter/buffer names on the router,
                        # dotted parameter paths of the banks) and how the banks are laid out
                        "router_weight": router[1],
                        "router_bias": router_b_name,
                        "correction_bias": correction_name,
                        "gate_first": gate_first,
                        "outputs": outputs,
                        "router_logits_output": logits_output,
                        "stochastic_in_training": stochastic,
                        "bank_rows": bank_rows,
                        **where,
                    }
    return None


def probe_routed_experts(
    module: nn.Module, path: str, width: int, top_k: int, scalars: list[float], generator
) -> dict[str, Any] | None:
    """Confirm expert banks called with their block's routing (``experts(hidden, index, weights)``): fresh banks,
    hidden states, distinct expert indices and weights; the module (float32, as grouped-GEMM experts run) against the
    float64 weighted sum of gated experts, over every bank reading, gate/up order, activation and input clamp (none,
    or one of the constants the module's trace passed to its ops).  Returns the variant's parameters, or None."""
    m = redrawn_copy(module, generator, scale=0.3, dtype=torch.float32)
    named = [(f"{path}.{name}", p.detach()) for name, p in m.named_parameters() if p.dim() == 3]
    if len(named) not in (2, 3) or len({bank.shape[0] for _, bank in named}) != 1:
        return None
    num_experts = named[0][1].shape[0]
    if top_k > num_experts:
        return None
    layouts = _expert_layouts([b for _, b in named], [n for n, _ in named], width, num_experts)
    tokens = 3 * num_experts  # every expert is reached, most by several tokens
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator, dtype=torch.float64) + 0.1
    # at unit scale and at 30x: a clamp or cap inside the experts (DeepSeek-V4's and gpt-oss's SwiGLU limits) changes
    # the large draw only, and what the kernels do not compute must not pass for them
    draws = [scale * torch.randn(tokens, width, generator=generator, dtype=torch.float64) for scale in (1.0, 30.0)]
    with torch.no_grad():
        outs = [m(x.float(), index, weights.float()) for x in draws]
        if not all(isinstance(out, torch.Tensor) and out.shape == x.shape for out, x in zip(outs, draws)):
            return None
        outs = [out.double() for out in outs]
        atol = float32_sum_tolerance(width + (layouts[0][0][2] if layouts else 0))
        limits = [None, *sorted({float(c) for c in scalars if 0.0 < c < 1e4})]
        for (layout, gate_first, where), (act_name, act), limit in itertools.product(
            layouts, ACTIVATIONS.items(), limits
        ):
            up, down, inner = layout
            refs = [
                _run_experts(x, weights, index, (up.double(), down.double(), inner), gate_first, act, False, limit)
                for x in draws
            ]
            if all(close(out / ref.abs().max(), ref / ref.abs().max(), atol=atol) for out, ref in zip(outs, refs)):
                return {
                    "kind": "routed_experts",
                    "width": width,
                    "num_experts": num_experts,
                    "top_k": top_k,
                    "activation": act_name,
                    "expert_width": inner,
                    "gate_first": gate_first,
                    "limit": limit,
                    **where,
                }
    return None


def stacked_banks(experts: nn.Module, width: int, path: str) -> tuple[list[str], list[torch.Tensor]]:
    """A list of gated MLPs as two banks: [E, 2I, width] (both width->I weights, in registration order) and
    [E, width, I]; empty when an expert is not two width->I projections and one I->width projection."""
    ups, downs = [], []
    for expert in experts:
        weights = [p for p in expert.parameters()]
        into = [w for w in weights if w.dim() == 2 and w.shape[1] == width and w.shape[0] != width]
        out = [w for w in weights if w.dim() == 2 and w.shape[0] == width and w.shape[1] != width]
        if len(into) != 2 or len(out) != 1 or len(weights) != 3 or into[0].shape != into[1].shape:
            return [], []
        ups.append(torch.cat(into, dim=0))
        downs.append(out[0])
    return [f"{path}.*.gate_up", f"{path}.*.down"], [torch.stack(ups).detach(), torch.stack(downs).detach()]


def _expert_layouts(banks: list[torch.Tensor], names: list[str], width: int, num_experts: int):
    """Possible (w_gate_up, w_down, inner) readings of the expert weights as [E, out, in] views, each with the banks
    it came from and whether each is stored [E, out, in] ("out_in") or [E, in, out].  Two banks: gate and up fused in
    one, and down.  Three: gate, up and down apart (DBRX), the gate and up read as one fused view (gate first).  A
    bank whose inner size equals the width is read both ways."""
    named = [(n, b) for n, b in zip(names, banks) if b.shape[0] == num_experts]
    if len(named) not in (2, 3):
        return []
    layouts = []
    for order in itertools.permutations(named, len(named)):
        *into, (down_name, down) = order
        for into_layout, down_layout in itertools.product(("out_in", "in_out"), repeat=2):
            into_v = [b if into_layout == "out_in" else b.transpose(1, 2) for _, b in into]
            down_v = down if down_layout == "out_in" else down.transpose(1, 2)
            if any(b.shape[2] != width for b in into_v) or down_v.shape[1] != width:
                continue
            up_v = torch.cat(into_v, dim=1) if len(into_v) == 2 else into_v[0]
            if up_v.shape[1] != 2 * down_v.shape[2]:
                continue
            where = {
                "gate_up_bank": into[0][0],
                "up_bank": into[1][0] if len(into) == 2 else None,
                "gate_up_layout": into_layout,
                "down_bank": down_name,
                "down_layout": down_layout,
            }
            for gate_first in (True, False) if len(into) == 1 else (True,):
                layouts.append(((up_v, down_v, down_v.shape[2]), gate_first, where))
    return layouts


def _output_structure(out, router_logits: torch.Tensor) -> str:
    """What the module returns: "hidden", "hidden+router_logits" (a pair whose second item equals the
    router's ``[tokens, experts]`` logits), or "other"."""
    if isinstance(out, torch.Tensor):
        return "hidden"
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor):
        if out[1].shape == router_logits.shape and close(out[1].double(), router_logits):
            return "hidden+router_logits"
    return "other"


def _named(owners: list[tuple[str, nn.Module]], which: str):
    """The ``which`` ("named_parameters"/"named_buffers") tensors each module owns itself, named from the router."""
    for prefix, module in owners:
        for name, tensor in getattr(module, which)(recurse=False):
            yield (f"{prefix}.{name}" if prefix else name), tensor


def _output_bias(module: nn.Module, width: int, router_bias: str | None) -> tuple[str | None, torch.Tensor | None]:
    """The MoE module's own ``[width]`` parameter, a candidate bias added to the combined output."""
    own = ((n, p) for n, p in module.named_parameters(recurse=False) if n != router_bias)
    return next(((n, p.detach().double()) for n, p in own if p.dim() == 1 and p.shape[0] == width), (None, None))


def _per_expert_vector(named, num_experts: int) -> tuple[str | None, torch.Tensor | None]:
    """The first ``[num_experts]`` tensor among the router's own parameters or buffers (a bias, a selection bias)."""
    return next(((n, t) for n, t in named if t.dim() == 1 and t.shape[0] == num_experts), (None, None))


def _stochastic_in_training(module: nn.Module, x: torch.Tensor) -> bool:
    """True when two training-mode calls on one input differ (router jitter noise, dropout): the
    reference above only describes the module's eval-mode function.  The caller's RNG is untouched."""
    was_training = module.training
    module.train()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            first, second = (module(x.clone()) for _ in range(2))
    finally:
        module.train(was_training)
    first, second = (o[0] if isinstance(o, tuple) else o for o in (first, second))
    return not torch.equal(first, second)


def _logits_output(router_mod: nn.Module, x2d: torch.Tensor, logits: torch.Tensor) -> int | None:
    """Position of the router logits among the router module's outputs (0 for a bare tensor), or None
    when it does not return them or cannot be called on ``[tokens, width]`` alone."""
    try:
        out = router_mod(x2d)
    except Exception:  # a router needing more than the hidden states is read through its weights instead
        return None
    outs = out if isinstance(out, tuple) else (out,)
    for position, item in enumerate(outs):
        same_size = isinstance(item, torch.Tensor) and item.is_floating_point() and item.numel() == logits.numel()
        if same_size and close(item.reshape(logits.shape).double(), logits):
            return position
    return None


def _run_experts(x2d, weights, index, layout, gate_first, act, normalize, limit=None):
    """The reference weighted sum of gated experts; ``limit`` clamps the gate from above and the linear half to
    ``[-limit, limit]`` before the unit (DeepSeek-V4's SwiGLU limit)."""
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
            if limit is not None:
                gate, lin = gate.clamp(max=limit), lin.clamp(-limit, limit)
            y = (act(gate) * lin) @ down[expert].t()
            out[rows] += weights[rows, slot : slot + 1] * y
    return out
