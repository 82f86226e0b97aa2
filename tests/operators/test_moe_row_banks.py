"""Experts stacked in the rows of 2-D matrices ([experts x inner, width], DBRX's layout), with gate and up in one
matrix or in two: recognised as one routed MoE against the float64 reference, their banks read as 3-D views, and run
on the grouped-GEMM kernels (gate and up apart: two grouped GEMMs, no copy) with the module's own function."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops_testlib import assert_patched_moe_matches_float64
from torch import nn

from operators import load_profile, plan_kernels
from operators.inventory import trace_callable
from operators.providers import triton_moe
from operators.recognition import recognise
from operators.registry import Target

pytest.importorskip("triton")

WIDTH, EXPERTS, INNER = 24, 5, 12


@pytest.fixture(autouse=True)
def every_test_draws_fresh(fresh_seed):
    return fresh_seed


class Ledger(nn.Module):
    """The experts' matrices as bare 2-D parameters, experts in the rows; each expert's slice read by a view."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        scale = WIDTH**-0.5
        if fused:
            self.valve_lift = nn.Parameter(scale * torch.randn(EXPERTS * 2 * INNER, WIDTH))
        else:
            self.valve = nn.Parameter(scale * torch.randn(EXPERTS * INNER, WIDTH))
            self.lift = nn.Parameter(scale * torch.randn(EXPERTS * INNER, WIDTH))
        self.drop = nn.Parameter(INNER**-0.5 * torch.randn(EXPERTS * INNER, WIDTH))  # used as rows @ drop[e]

    def forward(self, rows: torch.Tensor, e: int) -> torch.Tensor:
        if self.fused:
            lift, valve = (rows @ self.valve_lift.view(EXPERTS, 2 * INNER, WIDTH)[e].t()).chunk(2, dim=-1)
        else:
            valve = rows @ self.valve.view(EXPERTS, INNER, WIDTH)[e].t()
            lift = rows @ self.lift.view(EXPERTS, INNER, WIDTH)[e].t()
        return (F.gelu(valve, approximate="tanh") * lift) @ self.drop.view(EXPERTS, INNER, WIDTH)[e]


class Exchange(nn.Module):
    """Softmax router, top-k, weights renormalised; a loop over the experts the tokens chose."""

    def __init__(self, fused: bool, k: int):
        super().__init__()
        self.k = k
        self.ticker = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.ledger = Ledger(fused)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, WIDTH)
        weights, chosen = self.ticker(flat).softmax(dim=-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(EXPERTS):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, self.ledger(flat[token], e) * weights[token, slot, None])
        return out.view_as(h)


class Floor(nn.Module):
    def __init__(self, fused: bool, k: int):
        super().__init__()
        self.exchange = Exchange(fused, k)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.exchange(h)


def _margin(exchange: Exchange, x: torch.Tensor) -> float:
    """Smallest gap between each token's k-th and next router score: near-ties may route differently."""
    with torch.no_grad():
        ranked = exchange.ticker(x.reshape(-1, WIDTH)).sort(dim=-1, descending=True).values
    return float((ranked[:, exchange.k - 1] - ranked[:, exchange.k]).min())


@pytest.mark.parametrize("fused", [True, False])
def test_row_stacked_expert_matrices_are_one_routed_moe_on_the_grouped_kernels(rng, fused):
    floor = Floor(fused, k=rng.randint(2, 3))
    recognition = recognise(floor, trace_callable(floor, torch.randn(2, 3, WIDTH)))
    (moe,) = [c for c in recognition.components if c.kind == "moe"]
    v = moe.variant
    assert moe.module == "exchange" and moe.confirmed
    assert (v.num_experts, v.top_k, v.normalize_topk, v.activation, v.expert_width) == (
        EXPERTS, floor.exchange.k, True, "gelu_tanh", INNER,
    )  # fmt: skip
    assert v.bank_rows and (v.gate_up_layout, v.down_layout) == ("out_in", "in_out")
    banks = (v.gate_up_bank, v.up_bank, v.down_bank)
    if fused:
        assert banks == ("exchange.ledger.valve_lift", None, "exchange.ledger.drop") and not v.gate_first
    else:
        assert banks == ("exchange.ledger.valve", "exchange.ledger.lift", "exchange.ledger.drop") and v.gate_first
    choice = plan_kernels(
        trace_callable(floor, torch.randn(2, 3, WIDTH)),
        recognition,
        load_profile("cuda-hopper"),
        Target("cpu", "float32", True, None),
    ).component("exchange", "moe")
    assert (choice.provider, choice.kernel, choice.patch) == ("adapt-triton", "moe_grouped_gemm", True)

    x = torch.randn(2, 5, WIDTH)
    while _margin(floor.exchange, x) < 1e-3:
        x = torch.randn(2, 5, WIDTH)
    assert_patched_moe_matches_float64(floor.exchange, triton_moe.moe_forward(floor.exchange, moe), x)


def test_dbrx_experts_are_recognised_and_patched(tmp_path):
    """DBRX keeps its gate, up and down banks as three [experts x inner, width] matrices behind a router module that
    holds its projection one level down (``router.layer``)."""
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    from operators import run_ops

    if "dbrx" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no dbrx")
    config = AutoConfig.for_model(
        "dbrx", d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=128,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"hidden_size": 32, "ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "dbrx")
    target = Target("cpu", "float32", True, None, prefer=["adapt-triton"])
    report = run_ops(str(tmp_path / "dbrx"), onnx=False, target=target)
    moe = [c for c in report.plan.components if c.kind == "moe"]
    assert len(moe) == 2 and all((c.provider, c.patch) == ("adapt-triton", True) for c in moe)
    variant = next(c for c in report.recognition.components if c.kind == "moe").variant
    assert variant.bank_rows and variant.up_bank is not None and variant.router_weight == "layer.weight"
    assert report.patch_check.passed, report.patch_check
