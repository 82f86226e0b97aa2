"""Rotary position embedding for q and k in one launch: half-rotation or interleaved, partial rotary.

``cos``/``sin`` come from the model's own rotary module in Hugging Face's layout
(``[b or 1, s, rotary_dim]``, frequencies repeated as ``cat(f, f)``), so position ids and every
scaling variant of the config (linear, dynamic, YaRN, llama3, ...) are already folded in. The kernel
reads only the first half of each (one value per rotated pair) and writes outputs in the inputs'
memory layout; dims past ``rotary_dim`` are copied through. The backward is the inverse
rotation, i.e. the same kernel with ``sin`` negated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._registration import launch
from ._utils import next_pow2


@triton.jit
def _rotate_heads(
    X,
    OUT,
    x_base,
    stride_h,
    stride_d,
    out_base,
    out_stride_h,
    out_stride_d,
    tokens_ok,
    H,
    D,
    half,
    c,
    s,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One [tokens, heads, pairs] tile: ``x_base``/``out_base`` are per-token offsets, ``c``/``s`` [tokens, pairs]."""
    heads = tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_R)
    mask = tokens_ok[:, None, None] & (heads < H)[None, :, None] & (pairs < half)[None, None, :]
    if INTERLEAVED:
        first = 2 * pairs
        second = first + 1
    else:
        first = pairs
        second = pairs + half
    x_rows = X + x_base[:, None, None] + heads[None, :, None].to(tl.int64) * stride_h
    out_rows = OUT + out_base[:, None, None] + heads[None, :, None].to(tl.int64) * out_stride_h
    x1 = tl.load(x_rows + first[None, None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + second[None, None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    cc = c[:, None, :]
    ss = s[:, None, :]
    tl.store(out_rows + first[None, None, :] * out_stride_d, (x1 * cc - x2 * ss).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out_rows + second[None, None, :] * out_stride_d, (x2 * cc + x1 * ss).to(OUT.dtype.element_ty), mask=mask)
    if BLOCK_P > 0:  # partial rotary: the dims past rotary_dim pass through unchanged
        rest = 2 * half + tl.arange(0, BLOCK_P)
        rest_mask = tokens_ok[:, None, None] & (heads < H)[None, :, None] & (rest < D)[None, None, :]
        tail = tl.load(x_rows + rest[None, None, :] * stride_d, mask=rest_mask, other=0.0)
        tl.store(out_rows + rest[None, None, :] * out_stride_d, tail, mask=rest_mask)


@triton.jit
def _rope_kernel(
    Q,
    K,
    COS,
    SIN,
    QO,
    KO,
    S,
    N,
    HQ,
    HK,
    D,
    half,
    q_sb,
    q_sh,
    q_ss,
    q_sd,
    k_sb,
    k_sh,
    k_ss,
    k_sd,
    c_sb,
    c_ss,
    c_sd,
    qo_sb,
    qo_sh,
    qo_ss,
    qo_sd,
    ko_sb,
    ko_sh,
    ko_ss,
    ko_sd,
    INTERLEAVED: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """``BLOCK_T`` consecutive (batch, position) tokens of the ``N`` per program, every head of q and k."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tokens_ok = tokens < N
    b = tokens // S
    pos = tokens % S
    pairs = tl.arange(0, BLOCK_R)
    cs_offset = (b * c_sb + pos * c_ss)[:, None] + pairs[None, :] * c_sd
    cs_mask = tokens_ok[:, None] & (pairs < half)[None, :]
    c = tl.load(COS + cs_offset, mask=cs_mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + cs_offset, mask=cs_mask, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    _rotate_heads(
        Q,
        QO,
        b * q_sb + pos * q_ss,
        q_sh,
        q_sd,
        b * qo_sb + pos * qo_ss,
        qo_sh,
        qo_sd,
        tokens_ok,
        HQ,
        D,
        half,
        c,
        s,
        INTERLEAVED,
        BLOCK_HQ,
        BLOCK_R,
        BLOCK_P,
    )
    _rotate_heads(
        K,
        KO,
        b * k_sb + pos * k_ss,
        k_sh,
        k_sd,
        b * ko_sb + pos * ko_ss,
        ko_sh,
        ko_sd,
        tokens_ok,
        HK,
        D,
        half,
        c,
        s,
        INTERLEAVED,
        BLOCK_HK,
        BLOCK_R,
        BLOCK_P,
    )


# Elements of one program's q tile under Triton's CPU interpreter, which pays per operation, not per
# element: a few wide programs instead of one per token.  On a GPU every token keeps its own program.
INTERPRETER_TILE = 1 << 15


def tokens_per_program(device: torch.device, tokens: int, tile: int) -> int:
    """One token per program on a GPU (the launch that was measured); as many as fit ``INTERPRETER_TILE`` on
    the CPU, where only the interpreter runs Triton."""
    if device.type != "cpu":
        return 1
    return max(1, min(next_pow2(tokens), INTERPRETER_TILE // tile))


def rotate(q, k, cos, sin, interleaved, rotary_dim, inverse, q_out_stride=None, k_out_stride=None):
    """Outputs take the inputs' memory layout (``empty_like``) unless strides are given: HF's
    ``[b, s, h, d]``-backed q/k stay that way, so neither output nor gradient needs a relayout copy."""
    bsz, hq, seq, dim = q.shape
    hk = k.shape[1]
    qo = (
        torch.empty_strided(q.shape, q_out_stride, dtype=q.dtype, device=q.device)
        if q_out_stride
        else torch.empty_like(q)
    )
    ko = (
        torch.empty_strided(k.shape, k_out_stride, dtype=k.dtype, device=k.device)
        if k_out_stride
        else torch.empty_like(k)
    )
    half = rotary_dim // 2
    block_r = next_pow2(half)
    block_p = next_pow2(dim - rotary_dim) if dim > rotary_dim else 0
    c_sb = cos.stride(0) if cos.shape[0] > 1 else 0
    tile = max(next_pow2(hq), next_pow2(hk)) * block_r
    tokens = bsz * seq
    block_t = tokens_per_program(q.device, tokens, tile)
    launch(_rope_kernel)[(triton.cdiv(tokens, block_t),)](
        q,
        k,
        cos,
        sin,
        qo,
        ko,
        seq,
        tokens,
        hq,
        hk,
        dim,
        half,
        *q.stride(),
        *k.stride(),
        c_sb,
        cos.stride(1),
        cos.stride(2),
        *qo.stride(),
        *ko.stride(),
        INTERLEAVED=interleaved,
        INVERSE=inverse,
        BLOCK_T=block_t,
        BLOCK_HQ=next_pow2(hq),
        BLOCK_HK=next_pow2(hk),
        BLOCK_R=block_r,
        BLOCK_P=block_p,
        num_warps=int(min(16, max(1, tile // 256))),
    )
    return qo, ko
