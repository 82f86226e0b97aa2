"""Grouped GEMM for MoE experts: ``y[rows of e] = x[rows of e] @ w[e]`` for every expert in one launch.

Rows are sorted by expert (``moe_permute``) and ``group_offsets[e]:group_offsets[e+1]`` are expert
``e``'s rows. The launch grid is an upper bound on the number of row tiles
(``cdiv(M, BLOCK_M) + E``) known on the host, and a small device-side tile map tells each program
its expert, so no host synchronisation is needed. The input gradient reuses the same kernel with
``w`` read transposed through its strides; the weight gradient is a second kernel in which each
program owns one output tile of one expert and walks that expert's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._utils import cdiv, interpreting


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


_INTERPRETER_CONFIG = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)


def config_for(config: GemmConfig | None) -> GemmConfig:
    return config or (_INTERPRETER_CONFIG if interpreting() else GemmConfig())


@triton.jit
def _dot(a, b, acc, FP32_IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # Triton's CPU interpreter mis-multiplies bf16 operands; fp32 products of bf16 are exact
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if FP32_IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _grouped_mm_kernel(
    A,
    B,
    C,
    OFFSETS,
    TILE_EXPERT,
    TILE_FIRST,
    N,
    K,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    FP32_IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile)
    if expert < 0:
        return
    row_end = tl.load(OFFSETS + expert + 1)
    row_start = tl.load(OFFSETS + expert) + (tile - tl.load(TILE_FIRST + expert)) * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    a_ptrs = A + rows[:, None].to(tl.int64) * stride_am + tl.arange(0, BLOCK_K)[None, :] * stride_ak
    b_ptrs = (
        B + expert.to(tl.int64) * stride_be + tl.arange(0, BLOCK_K)[:, None] * stride_bk + cols[None, :] * stride_bn
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + tl.arange(0, BLOCK_K) < K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(a, b, acc, FP32_IEEE, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = C + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_weight_grad_kernel(
    X,
    DY,
    DW,
    OFFSETS,
    K,
    N,
    stride_xm,
    stride_dym,
    stride_we,
    stride_wk,
    stride_wn,
    FP32_IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    ks = (tl.program_id(1) // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = (tl.program_id(1) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = ks < K
    col_mask = cols < N
    row_start = tl.load(OFFSETS + expert)
    row_end = tl.load(OFFSETS + expert + 1)
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        x = tl.load(
            X + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        dy = tl.load(
            DY + rows[:, None].to(tl.int64) * stride_dym + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc = _dot(tl.trans(x), dy, acc, FP32_IEEE, UPCAST)
    dw_ptrs = DW + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreting()


def _tile_map(group_offsets: torch.Tensor, rows: int, block_m: int):
    """(tile -> expert or -1, first tile of each expert, grid size), computed on device without a sync."""
    counts = group_offsets[1:] - group_offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    upper = cdiv(rows, block_m) + counts.numel()
    tile_ids = torch.arange(upper, device=group_offsets.device)
    expert = torch.searchsorted(ends, tile_ids, right=True)
    expert = torch.where(expert < counts.numel(), expert, -1).to(torch.int32)
    return expert, (ends - tiles).to(torch.int32), upper


def grouped_mm(x, w, group_offsets, transpose_w: bool, config: GemmConfig):
    """``x @ w[e]`` (or ``x @ w[e].T``) per expert row group; w is [E, K, N]."""
    rows = x.shape[0]
    _, wk, wn = w.shape
    k, n = (wn, wk) if transpose_w else (wk, wn)
    stride_bk, stride_bn = (w.stride(2), w.stride(1)) if transpose_w else (w.stride(1), w.stride(2))
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    tile_expert, tile_first, upper = _tile_map(group_offsets, rows, config.block_m)
    grid = (upper, cdiv(n, config.block_n))
    _grouped_mm_kernel[grid](
        x,
        w,
        out,
        group_offsets,
        tile_expert,
        tile_first,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        stride_bk,
        stride_bn,
        out.stride(0),
        FP32_IEEE=x.dtype == torch.float32,
        UPCAST=_upcast(x.dtype),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def grouped_weight_grad(x, dy, w, group_offsets, config: GemmConfig):
    """``dw[e] = x[rows of e].T @ dy[rows of e]`` for every expert, in ``w``'s memory layout."""
    experts, k, n = w.shape
    dw = torch.empty_like(w)
    block_k = max(config.block_k, 32)
    grid = (experts, cdiv(k, block_k) * cdiv(n, config.block_n))
    _grouped_weight_grad_kernel[grid](
        x,
        dy,
        dw,
        group_offsets,
        k,
        n,
        x.stride(0),
        dy.stride(0),
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
        FP32_IEEE=x.dtype == torch.float32,
        UPCAST=_upcast(x.dtype),
        BLOCK_M=config.block_k,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return dw


def encode_config(config: GemmConfig | None) -> list[int]:
    """A GemmConfig as the integer list a torch.library operator takes (empty: the device's default)."""
    if config is None:
        return []
    return [config.block_m, config.block_n, config.block_k, config.num_warps, config.num_stages]


def decode_config(values: list[int]) -> GemmConfig:
    return GemmConfig(*values) if values else config_for(None)
