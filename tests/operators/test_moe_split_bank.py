"""Experts kept in a module that holds a 3-D weight bank and splits its rows by per-expert counts given as Python
integers (JetMoE's layout), behind a gating module that runs the top-k over a child projection: recognised as one
routed MoE, its routing read from the numbers, and run on the grouped-GEMM kernels with the module's function."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from ops_testlib import assert_patched_moe_matches_float64
from torch import nn

from operators import load_profile, plan_kernels
from operators.inventory import trace_callable
from operators.providers import triton_moe
from operators.recognition import Component, recognise
from operators.registry import Target

pytest.importorskip("triton")

WIDTH, EXPERTS, INNER = 24, 5, 10


@pytest.fixture(autouse=True)
def every_test_draws_fresh(fresh_seed):
    return fresh_seed


class Dealer(nn.Module):
    """Scores every expert with a child projection and hands out rows: their order by expert, each sorted row's
    token and weight, the per-expert counts as Python integers, and the logits."""

    def __init__(self, scoring: str, k: int):
        super().__init__()
        self.scoring, self.k = scoring, k
        self.score = nn.Linear(WIDTH, EXPERTS)

    def forward(self, flat: torch.Tensor):
        logits = self.score(flat)
        if self.scoring == "sigmoid":  # the chosen sigmoid scores as they are
            weights, chosen = torch.sigmoid(logits).topk(self.k, dim=-1)
        else:  # a softmax over the chosen logits: the full softmax renormalised over the chosen experts
            best, chosen = logits.topk(self.k, dim=-1)
            weights = best.softmax(dim=-1)
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=EXPERTS).tolist()
        return order, order // self.k, weights.flatten()[order], counts, logits


class Shelf(nn.Module):
    """One [experts, out, in] weight; the rows arrive grouped by expert, ``counts`` rows each."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.slab = nn.Parameter(torch.randn(EXPERTS, fan_out, fan_in) / fan_in**0.5)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return torch.cat([part @ self.slab[e].t() for e, part in enumerate(rows.split(counts))])


class Guild(nn.Module):
    def __init__(self, scoring: str, k: int):
        super().__init__()
        self.dealer = Dealer(scoring, k)
        self.widen, self.narrow = Shelf(WIDTH, 2 * INNER), Shelf(INNER, WIDTH)
        self.lean = nn.Parameter(0.1 * torch.randn(WIDTH))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, WIDTH)
        _, token, weights, counts, _ = self.dealer(flat)
        lift, valve = self.widen(flat[token], counts).chunk(2, dim=-1)
        out = self.narrow(F.silu(valve) * lift, counts) * weights[:, None]
        return (torch.zeros_like(flat).index_add(0, token, out) + self.lean).view_as(h)


class Hall(nn.Module):
    def __init__(self, scoring: str, k: int):
        super().__init__()
        self.guild = Guild(scoring, k)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.guild(h)


def routing_margin(guild: Guild, x: torch.Tensor) -> float:
    """Smallest float64 gap between each token's k-th and next expert score: near-ties may route differently."""
    with torch.no_grad():
        ranked = guild.dealer.score(x.reshape(-1, WIDTH)).sort(dim=-1, descending=True).values
    k = guild.dealer.k
    return float((ranked[:, k - 1] - ranked[:, k]).min())


@pytest.mark.parametrize("scoring,call_router", [("softmax", True), ("sigmoid", False)])
def test_experts_split_by_python_counts_are_one_routed_moe_on_the_grouped_kernels(rng, scoring, call_router):
    k = rng.randint(2, 3)  # a single softmax choice weighs 1: the router would get no gradient
    hall = Hall(scoring, k)
    recognition = recognise(hall, trace_callable(hall, torch.randn(2, 3, WIDTH)))
    (moe,) = [c for c in recognition.components if c.kind == "moe"]
    v = moe.variant
    assert moe.module == "guild" and moe.confirmed
    assert (v.scoring, v.top_k, v.normalize_topk, v.num_experts, v.n_group) == (
        scoring,
        k,
        scoring == "softmax",
        EXPERTS,
        1,
    )
    assert (v.router, v.router_weight, v.router_bias, v.router_logits_output) == (
        "guild.dealer",
        "score.weight",
        "score.bias",
        4,
    )
    assert (v.expert_container, v.gate_up_bank, v.down_bank, v.gate_first, v.activation, v.output_bias) == (
        "bank",
        "guild.widen.slab",
        "guild.narrow.slab",
        False,
        "silu",
        "lean",
    )
    assert not any(c.kind == "new" for c in recognition.components)  # the banks' modules belong to the MoE
    choice = plan_kernels(
        trace_callable(hall, torch.randn(2, 3, WIDTH)),
        recognition,
        load_profile("cuda-hopper"),
        Target("cpu", "float32", True, None),
    ).component("guild", "moe")
    assert (choice.provider, choice.kernel, choice.patch) == ("adapt-triton", "moe_grouped_gemm", True)

    if not call_router:  # the logits from the router's weights, found through its child projection
        v = dataclasses.replace(v, router_logits_output=None)
    x = torch.randn(2, 5, WIDTH)
    while routing_margin(hall.guild, x) < 1e-3:
        x = torch.randn(2, 5, WIDTH)
    patched = triton_moe.moe_forward(hall.guild, Component("guild", "moe", v, True))
    assert_patched_moe_matches_float64(hall.guild, patched, x)
