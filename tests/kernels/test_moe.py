"""MoE routing, permute/unpermute and the grouped GEMM against float64 references."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, assert_close, leaf, ref_leaf

from operators.kernels import grouped_gemm, moe_permute, moe_route, moe_unpermute, swiglu


def reference_route(logits, top_k, scoring, n_group, topk_group, normalize, bias, scale):
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores + bias if bias is not None else scores.clone()
    if n_group > 1:
        grouped = choice.view(choice.shape[0], n_group, -1)
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scale, ids


ROUTINGS = {
    "mixtral_softmax": dict(
        experts=8, top_k=2, scoring="softmax", n_group=1, topk_group=1, normalize=True, bias=False, scale=1.0
    ),
    "qwen_softmax_unnormalised": dict(
        experts=60, top_k=4, scoring="softmax", n_group=1, topk_group=1, normalize=False, bias=False, scale=1.0
    ),
    "deepseek_v3_grouped_sigmoid": dict(
        experts=64, top_k=6, scoring="sigmoid", n_group=8, topk_group=3, normalize=True, bias=True, scale=2.5
    ),
}


@pytest.mark.parametrize("name", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route(name, dtype):
    cfg = dict(ROUTINGS[name])
    experts = cfg.pop("experts")
    bias = torch.randn(experts, device=DEVICE) * 0.1 if cfg.pop("bias") else None
    # distinct logits on a grid exact in bf16, randomly permuted per token: no ties, so the choice is unique
    grid = (torch.rand(21, experts, device=DEVICE).argsort(-1) - experts / 2) * (4.0 / experts)
    logits_in = grid.view(3, 7, experts).to(dtype)
    logits, logits64 = leaf(logits_in), ref_leaf(logits_in)
    weights, ids = moe_route(logits, correction_bias=bias, **cfg)
    ref_w, ref_ids = reference_route(
        logits64.view(-1, experts), bias=bias.double() if bias is not None else None, **cfg
    )
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), ref_ids.cpu())
    assert_close(weights, ref_w, torch.float32, scale=10)
    dw = torch.randn_like(weights)
    weights.backward(dw)
    ref_w.backward(dw.double())
    assert_close(logits.grad, logits64.grad, dtype, scale=2, what="dlogits")


def test_permute_sorts_rows_by_expert():
    x = torch.randn(13, 40, device=DEVICE)
    ids = torch.stack([torch.randperm(6, device=DEVICE)[:3] for _ in range(13)])
    x_sorted, state = moe_permute(x, ids, 6)
    counts = torch.bincount(ids.flatten(), minlength=6)
    assert torch.equal(state.group_offsets[1:].cpu(), counts.cumsum(0).cpu()) and state.group_offsets[0] == 0
    experts_in_order = ids.flatten()[state.sorted_position.flatten().argsort()]
    assert torch.equal(experts_in_order.cpu(), experts_in_order.sort().values.cpu())
    assert torch.equal(x_sorted.cpu(), x[state.source_token].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grouped_gemm_against_per_expert_mm(dtype):
    experts, k, n = 5, 48, 40
    counts = torch.tensor([7, 0, 33, 1, 19], device=DEVICE)  # an empty expert and a single-row one
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=DEVICE), counts.cumsum(0)])
    x_in = torch.randn(int(counts.sum()), k, device=DEVICE, dtype=dtype)
    w_in = torch.randn(experts, k, n, device=DEVICE, dtype=dtype) / k**0.5
    x, w = leaf(x_in), leaf(w_in)
    x64, w64 = ref_leaf(x_in), ref_leaf(w_in)
    y = grouped_gemm(x, w, offsets)
    bounds = offsets.tolist()
    ref = torch.cat([x64[bounds[e] : bounds[e + 1]] @ w64[e] for e in range(experts)])
    assert_close(y, ref, dtype, what="y")
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    assert_close(x.grad, x64.grad, dtype, scale=2, what="dx")
    assert_close(w.grad, w64.grad, dtype, scale=2, what="dw")
    assert w.grad[1].abs().max() == 0  # the empty expert gets an exact zero gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_end_to_end(dtype):
    """route -> permute -> grouped GEMM (gate_up) -> SwiGLU -> grouped GEMM (down) -> unpermute."""
    tokens, hidden, ffn, experts, top_k = 19, 32, 24, 6, 2
    x_in = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype)
    logits_in = torch.randn(tokens, experts, device=DEVICE, dtype=dtype)
    w1_in = (torch.randn(experts, hidden, 2 * ffn, device=DEVICE) / hidden**0.5).to(dtype)
    w2_in = (torch.randn(experts, ffn, hidden, device=DEVICE) / ffn**0.5).to(dtype)
    x, logits, w1, w2 = (leaf(t) for t in (x_in, logits_in, w1_in, w2_in))
    x64, logits64, w164, w264 = (ref_leaf(t) for t in (x_in, logits_in, w1_in, w2_in))

    weights, ids = moe_route(logits, top_k)
    x_sorted, state = moe_permute(x, ids, experts)
    gate_up = grouped_gemm(x_sorted, w1, state.group_offsets)
    hidden_act = swiglu(gate_up[:, :ffn], gate_up[:, ffn:])
    y = moe_unpermute(grouped_gemm(hidden_act, w2, state.group_offsets), weights, state)

    ref_weights = logits64.softmax(-1).gather(1, ids)
    ref_weights = ref_weights / ref_weights.sum(-1, keepdim=True)
    ref_rows = []
    for t in range(tokens):
        row = 0
        for slot in range(top_k):
            e = int(ids[t, slot])
            gu = x64[t] @ w164[e]
            row = row + ref_weights[t, slot] * ((torch.nn.functional.silu(gu[:ffn]) * gu[ffn:]) @ w264[e])
        ref_rows.append(row)
    ref = torch.stack(ref_rows)
    assert_close(y, ref, dtype, scale=2, what="y")
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    for name, ours, theirs in (("dx", x, x64), ("dlogits", logits, logits64), ("dw1", w1, w164), ("dw2", w2, w264)):
        assert_close(ours.grad, theirs.grad, dtype, scale=3, what=name)


def test_route_rejects_bad_groups():
    with pytest.raises(ValueError):
        moe_route(torch.randn(4, 10, device=DEVICE), 2, n_group=3)
    with pytest.raises(ValueError):
        moe_route(torch.randn(4, 8, device=DEVICE), 9)
