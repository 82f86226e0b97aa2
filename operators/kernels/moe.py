"""MoE dispatch: top-k routing, token permute by expert, and the weighted unpermute.

Routing runs one token per program: softmax or sigmoid scores, an optional selection bias
(DeepSeek-V3's ``e_score_correction_bias``, which changes the choice but not the weights), grouped
top-k (keep the ``topk_group`` best groups, a group scored by the sum of its two best experts), then
top-k, renormalisation and scaling. Its backward sends the weight gradient to the router logits.
Permute sorts the (token, slot) pairs by expert with a stable sort on device and gathers rows;
unpermute sums each token's ``top_k`` expert outputs with their weights, reading rows in place.
Both are deterministic in backward (per-token sums, no atomics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._utils import cdiv, next_pow2

SCORINGS = {"softmax": 0, "sigmoid": 1}


@triton.jit
def _scores(z, mask, SCORING: tl.constexpr):
    if SCORING == 0:
        z = tl.where(mask, z, -float("inf"))
        p = tl.exp(z - tl.max(z, axis=0))
        return p / tl.sum(p, axis=0)
    return tl.where(mask, tl.sigmoid(z), 0.0)


@triton.jit
def _route_fwd(
    LOGITS,
    BIAS,
    WEIGHTS,
    IDS,
    E,
    stride_l,
    scale,
    TOP_K: tl.constexpr,
    SCORING: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    scores = _scores(tl.load(LOGITS + row * stride_l + experts, mask=valid, other=0.0).to(tl.float32), valid, SCORING)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(BIAS + experts, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, -float("inf"))
    if N_GROUP > 1:
        group_of = experts // (E // N_GROUP)
        groups = tl.arange(0, BLOCK_G)
        group_score = tl.full([BLOCK_G], -float("inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_group = tl.where(group_of == g, choice, -float("inf"))
            best = tl.argmax(in_group, axis=0)
            top2 = tl.max(in_group, axis=0) + tl.max(tl.where(experts == best, -float("inf"), in_group), axis=0)
            group_score = tl.where(groups == g, top2, group_score)
        keep = tl.zeros([BLOCK_E], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            g_best = tl.argmax(group_score, axis=0)
            keep = keep | (group_of == g_best)
            group_score = tl.where(groups == g_best, -float("inf"), group_score)
        choice = tl.where(keep, choice, -float("inf"))
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        weights = tl.where(slots == k, tl.sum(tl.where(experts == best, scores, 0.0), axis=0), weights)
        ids = tl.where(slots == k, best, ids)
        choice = tl.where(experts == best, -float("inf"), choice)
    if NORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(WEIGHTS + row * TOP_K + slots, weights * scale, mask=slots < TOP_K)
    tl.store(IDS + row * TOP_K + slots, ids.to(tl.int64), mask=slots < TOP_K)


@triton.jit
def _route_bwd(
    LOGITS,
    IDS,
    DWEIGHTS,
    DLOGITS,
    E,
    stride_l,
    scale,
    TOP_K: tl.constexpr,
    SCORING: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    scores = _scores(tl.load(LOGITS + row * stride_l + experts, mask=valid, other=0.0).to(tl.float32), valid, SCORING)
    slots = tl.arange(0, BLOCK_K)
    ids = tl.load(IDS + row * TOP_K + slots, mask=slots < TOP_K, other=-1)
    dweights = tl.load(DWEIGHTS + row * TOP_K + slots, mask=slots < TOP_K, other=0.0).to(tl.float32)
    picked = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert_k = tl.sum(tl.where(slots == k, ids, 0), axis=0)
        picked = tl.where(slots == k, tl.sum(tl.where(experts == expert_k, scores, 0.0), axis=0), picked)
    if NORMALIZE:  # w_k = scale * s_k / S  ->  ds_k = scale * (dw_k - sum_j dw_j w_j / scale) / S
        total = tl.sum(picked, axis=0) + 1e-20
        dpicked = scale * (dweights - tl.sum(dweights * picked, axis=0) / total) / total
    else:
        dpicked = scale * dweights
    dscores = tl.zeros([BLOCK_E], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert_k = tl.sum(tl.where(slots == k, ids, 0), axis=0)
        dscores += tl.where(experts == expert_k, tl.sum(tl.where(slots == k, dpicked, 0.0), axis=0), 0.0)
    if SCORING == 0:
        dlogits = scores * (dscores - tl.sum(dscores * scores, axis=0))
    else:
        dlogits = dscores * scores * (1.0 - scores)
    tl.store(DLOGITS + row * stride_l + experts, dlogits.to(DLOGITS.dtype.element_ty), mask=valid)


def route_forward(logits, top_k, scoring, n_group, topk_group, normalize, bias, scale):
    """(fp32 weights ``[T, k]``, int64 expert ids ``[T, k]``) for row-major ``logits`` ``[T, E]``."""
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    block_e = next_pow2(experts)
    if tokens:
        _route_fwd[(tokens,)](
            logits,
            bias if bias is not None else logits,
            weights,
            ids,
            experts,
            logits.stride(0),
            scale,
            TOP_K=top_k,
            SCORING=SCORINGS[scoring],
            N_GROUP=n_group,
            TOPK_GROUP=topk_group,
            HAS_BIAS=bias is not None,
            NORMALIZE=normalize,
            BLOCK_E=block_e,
            BLOCK_K=next_pow2(top_k),
            BLOCK_G=next_pow2(n_group),
            num_warps=4 if block_e <= 256 else 8,
        )
    return weights, ids


def route_backward(dweights, logits, ids, top_k, scoring, normalize, scale):
    """The router logits' gradient from the routing weights' gradient (the ids are piecewise constant)."""
    dlogits = torch.empty((logits.shape[0], logits.shape[1]), dtype=logits.dtype, device=logits.device)
    if logits.shape[0]:
        block_e = next_pow2(logits.shape[1])
        _route_bwd[(logits.shape[0],)](
            logits,
            ids,
            dweights.contiguous(),
            dlogits,
            logits.shape[1],
            logits.stride(0),
            scale,
            TOP_K=top_k,
            SCORING=SCORINGS[scoring],
            NORMALIZE=normalize,
            BLOCK_E=block_e,
            BLOCK_K=next_pow2(top_k),
            num_warps=4 if block_e <= 256 else 8,
        )
    return dlogits


@dataclass
class PermutationState:
    """How sorted rows map back to tokens; ``group_offsets`` (``E + 1``) feeds ``grouped_gemm``."""

    source_token: torch.Tensor  # [T*k] token that each sorted row came from
    sorted_position: torch.Tensor  # [T, k] row in the sorted order of each (token, slot)
    group_offsets: torch.Tensor  # [E + 1] first sorted row of each expert
    num_tokens: int
    top_k: int


@triton.jit
def _gather_rows(X, SOURCE, OUT, H, stride_x, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = tl.load(SOURCE + row).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    tl.store(OUT + row * H + cols, tl.load(X + src * stride_x + cols, mask=mask), mask=mask)


@triton.jit
def _combine_rows(
    Y,
    POSITION,
    WEIGHTS,
    OUT,
    H,
    stride_y,
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """OUT[t] = sum_k w[t, k] * Y[position[t, k]] (w = 1 when absent): unpermute, and permute's backward."""
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    slot_mask = slots < TOP_K
    pos = tl.load(POSITION + token * TOP_K + slots, mask=slot_mask, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = slot_mask[:, None] & (cols < H)[None, :]
    rows = tl.load(Y + pos[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHTS:
        w = tl.load(WEIGHTS + token * TOP_K + slots, mask=slot_mask, other=0.0).to(tl.float32)
        rows = rows * w[:, None]
    tl.store(OUT + token * H + cols, tl.sum(rows, axis=0).to(OUT.dtype.element_ty), mask=cols < H)


@triton.jit
def _unpermute_bwd(
    DY, Y, POSITION, WEIGHTS, DYS, DW, H, stride_y, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    slot_mask = slots < TOP_K
    pos = tl.load(POSITION + token * TOP_K + slots, mask=slot_mask, other=0).to(tl.int64)
    w = tl.load(WEIGHTS + token * TOP_K + slots, mask=slot_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_K], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = slot_mask[:, None] & (cols < H)[None, :]
        dy = tl.load(DY + token * H + cols, mask=cols < H, other=0.0).to(tl.float32)
        y = tl.load(Y + pos[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dw += tl.sum(y * dy[None, :], axis=1)
        tl.store(DYS + pos[:, None] * H + cols[None, :], (w[:, None] * dy[None, :]).to(DYS.dtype.element_ty), mask=mask)
    tl.store(DW + token * TOP_K + slots, dw.to(DW.dtype.element_ty), mask=slot_mask)


def _block_h(width: int) -> int:
    return min(1024, next_pow2(width))


def combine(y, position, weights, tokens, top_k):
    """``out[t] = sum_k weights[t, k] * y[position[t, k]]`` (weights of one when None)."""
    width = y.shape[1]
    out = torch.empty((tokens, width), dtype=y.dtype, device=y.device)
    if tokens:
        block_h = _block_h(width)
        _combine_rows[(tokens, cdiv(width, block_h))](
            y,
            position,
            weights if weights is not None else y,
            out,
            width,
            y.stride(0),
            TOP_K=top_k,
            HAS_WEIGHTS=weights is not None,
            BLOCK_K=next_pow2(top_k),
            BLOCK_H=block_h,
            num_warps=4,
        )
    return out


def sort_by_expert(expert_ids, num_experts):
    """(source token of each sorted row, sorted row of each (token, slot), ``E + 1`` group offsets)."""
    tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    if counts.numel() != num_experts:
        raise ValueError(f"expert ids exceed num_experts={num_experts}")
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert_ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=expert_ids.device)
    return (order // top_k).contiguous(), position.view(tokens, top_k), offsets


def gather(x, source_token):
    """``out[r] = x[source_token[r]]``: each token's row once per chosen expert, in sorted order."""
    rows, width = source_token.numel(), x.shape[1]
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows:
        block_h = _block_h(width)
        _gather_rows[(rows, cdiv(width, block_h))](
            x, source_token, out, width, x.stride(0), BLOCK_H=block_h, num_warps=4
        )
    return out


def unpermute_backward(dy, y_sorted, weights, sorted_position):
    """(d y_sorted, d weights) of the weighted combine; each token's rows are written by one program."""
    tokens, top_k = sorted_position.shape
    width = y_sorted.shape[1]
    dy_sorted = torch.empty((y_sorted.shape[0], width), dtype=y_sorted.dtype, device=y_sorted.device)
    dweights = torch.empty_like(weights)
    if tokens:
        _unpermute_bwd[(tokens,)](
            dy.contiguous(),
            y_sorted,
            sorted_position,
            weights,
            dy_sorted,
            dweights,
            width,
            y_sorted.stride(0),
            TOP_K=top_k,
            BLOCK_K=next_pow2(top_k),
            BLOCK_H=_block_h(width),
            num_warps=4,
        )
    return dy_sorted, dweights
