"""Numeric confirmation of an MLP candidate: which gated or plain composition of its projections it computes."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from adapt.model.activations import ACTIVATIONS
from operators.recognition.probes import close, grads_match, redrawn_copy


def probe_mlp(module: nn.Module, path: str, width: int, projections: list, generator) -> dict[str, Any] | None:
    """Gated (act(gate) * up -> down, separate or packed gate/up) or plain (act(up) -> down) MLP."""
    m = redrawn_copy(module, generator, scale=0.3)
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
