"""RMSNorm, fused residual-add + RMSNorm and LayerNorm: Triton forward and backward.

Forward kernels stream tiles of ``BLOCK_M`` whole rows, one program per tile, reading each row once
and writing it once (plus fp32 row statistics when a backward will need them). Backward kernels run a
persistent grid: each program keeps the weight in registers, walks its tiles with the next tile's loads
already in flight, accumulates the weight gradient in fp32 and writes one partial row; a single
``sum(0)`` finishes it, which keeps the reduction deterministic (no atomics).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._registration import launch
from ._utils import as_rows, cdiv, check_float, num_programs, row_block, warps_for

# The rounding order of an RMSNorm in a narrow dtype, as recognition measures it bit for bit:
#   round_then_scale: normalise in fp32, round to the input dtype, then multiply by the weight (Llama's order);
#   scale_then_round: normalise and scale in fp32, round once at the end (Gemma's order);
#   activation_dtype: the weight (with its offset) stays in the activation dtype.
CAST_MODES = {"round_then_scale": 0, "scale_then_round": 1, "activation_dtype": 2}


@dataclass(frozen=True)
class RowConfig:
    """Launch shape of a row kernel; ``None`` fields take the measured H200 defaults below."""

    block_m: int | None = None
    num_warps: int | None = None
    programs_per_sm: int | None = None  # 0: one program per tile (no persistent loop)
    prefetch: bool = True  # backward: issue the next tile's loads before reducing the current one


# Forward tile shapes by kernel, from the H200 launch sweeps (benchmarks/NOTES-kernels.md, run 4):
# (rows per program as a function of the padded width, elements per warp).  One program per tile.
#   rms_norm      1 row/4 warps at widths 2048-4096, 2 rows/8 warps at 8192 (within 0.5% of each shape's best)
#   add_rms_norm  one row per program, 256 elements per warp (its residual load and sum store need more warps)
#   layer_norm    4 rows per program, 2048 elements per warp (8192-wide: 0.386 -> 0.315 ms)
_FORWARD_TILES = {
    "rms_norm": (lambda block_n: 2048 // block_n if block_n <= 4096 else 2, 2048),
    "add_rms_norm": (lambda block_n: 2048 // block_n, 256),
    "layer_norm": (lambda block_n: max(4, 8192 // block_n) if block_n <= 8192 else 1, 2048),
}


@functools.lru_cache(maxsize=256)
def _tile(width: int, config: RowConfig | None, kernel: str, backward: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_M, num_warps, programs per SM, 0 for one program per tile); cached because it runs on every
    call, and keyed by the width alone, which the model fixes, so that a traced launch keeps its row count symbolic.

    Forward: one program per tile, shaped per kernel (``_FORWARD_TILES``): on H200 this beat a
    persistent loop (the hardware scheduler overlaps tiles better).  Backward: a persistent grid of
    16 resident warps per SM; each program prefetches its next tile, so few programs keep enough bytes
    in flight (2 programs of 8 warps beat 4 at widths 2048/4096, 1 of 16 at 8192).
    """
    config = config or RowConfig()
    block_n = row_block(width, 1)[0]
    if backward:
        block_m = max(1, min(16, 4096 // block_n))
        num_warps = warps_for(block_m * block_n)
    else:
        rows_for, elems_per_warp = _FORWARD_TILES[kernel]
        block_m = max(1, min(16, rows_for(block_n), 32768 // block_n))
        num_warps = int(min(16, max(4, block_m * block_n // elems_per_warp)))
    block_m = config.block_m or block_m
    num_warps = config.num_warps or num_warps
    per_sm = config.programs_per_sm
    if per_sm is None:
        per_sm = max(1, 16 // num_warps) if backward else 0
    return block_n, block_m, num_warps, per_sm


def _launch(width: int, rows: int, device: torch.device, config: RowConfig | None, kernel: str, backward: bool):
    """(BLOCK_N, BLOCK_M, num_warps, grid) for ``rows`` rows of ``width`` (``_tile``'s shape)."""
    block_n, block_m, num_warps, per_sm = _tile(width, config, kernel, backward)
    tiles = cdiv(rows, block_m)
    grid = tiles if per_sm == 0 else torch.sym_min(tiles, num_programs(device, per_sm))
    return block_n, block_m, num_warps, torch.sym_max(grid, 1)


@triton.jit
def _rms_norm_fwd(
    X,
    R,
    S,
    Y,
    W,
    RSTD,
    M,
    N,
    stride_x,
    stride_r,
    eps,
    offset,
    HAS_RESIDUAL: tl.constexpr,
    STORE_RSTD: tl.constexpr,
    CAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    if CAST == 2:  # activation_dtype: the weight (with offset) lives in the activation dtype
        w = w.to(Y.dtype.element_ty).to(tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
            tl.store(S + rows64[:, None] * N + cols[None, :], x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
        if CAST == 0:  # round_then_scale: normalise in fp32, round to the input dtype, then scale
            y = (xf * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32) * w[None, :]
        elif CAST == 1:  # scale_then_round: everything in fp32, one rounding at the end
            y = xf * rstd[:, None] * w[None, :]
        else:  # none: each elementwise step rounded to the input dtype
            rstd_low = rstd.to(Y.dtype.element_ty).to(tl.float32)
            y = (xf * rstd_low[:, None]).to(Y.dtype.element_ty).to(tl.float32) * w[None, :]
        tl.store(Y + rows64[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        if STORE_RSTD:
            tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _bwd_tile_loads(X, DY, tile, M, N, stride_dy, cols, col_mask, BLOCK_M: tl.constexpr):
    """One backward tile of x (saved contiguous) and dy, with its rows and row mask for the statistics."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * N + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    return x, dy, rows, row_mask


@triton.jit
def _rms_bwd_loads(X, DY, RSTD, tile, M, N, stride_dy, cols, col_mask, BLOCK_M: tl.constexpr):
    x, dy, rows, row_mask = _bwd_tile_loads(X, DY, tile, M, N, stride_dy, cols, col_mask, BLOCK_M)
    return x, dy, tl.load(RSTD + rows, mask=row_mask, other=0.0)


@triton.jit
def _rms_norm_bwd(
    DY,
    X,
    W,
    RSTD,
    DS,
    DX,
    DW_PARTIAL,
    M,
    N,
    stride_dy,
    stride_ds,
    offset,
    HAS_DS: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    CAST: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    if CAST == 2:
        w = w.to(DX.dtype.element_ty).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    step = tl.num_programs(0)
    if PREFETCH:  # software pipelining: the next tile's loads are in flight while this one is reduced
        x_next, dy_next, rstd_next = _rms_bwd_loads(X, DY, RSTD, pid, M, N, stride_dy, cols, col_mask, BLOCK_M)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), step):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        if PREFETCH:
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            rstd = rstd_next
            x_next, dy_next, rstd_next = _rms_bwd_loads(
                X, DY, RSTD, tile + step, M, N, stride_dy, cols, col_mask, BLOCK_M
            )
        else:
            x, dy, rstd = _rms_bwd_loads(X, DY, RSTD, tile, M, N, stride_dy, cols, col_mask, BLOCK_M)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
        normed = x * rstd[:, None]
        dnormed = dy * w[None, :]
        dx = rstd[:, None] * (dnormed - normed * (tl.sum(dnormed * normed, axis=1) / N)[:, None])
        if HAS_DS:
            dx += tl.load(DS + rows64[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if CAST != 1:  # the weight multiplied the normalised value after rounding
                normed = normed.to(DX.dtype.element_ty).to(tl.float32)
            dw += tl.sum(dy * normed, axis=0)
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * N + cols, dw, mask=col_mask)


def rms_forward(x, residual, weight, eps, offset, cast, config, need_rstd):
    check_float("x", x)
    if cast not in CAST_MODES:
        raise ValueError(f"cast must be one of {sorted(CAST_MODES)}, got {cast!r}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match width {x.shape[-1]}")
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else None
    rows, width = x2.shape
    y = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else None
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device) if need_rstd else None
    kernel = "rms_norm" if residual is None else "add_rms_norm"
    block_n, block_m, warps, grid = _launch(width, rows, x.device, config, kernel, False)
    launch(_rms_norm_fwd)[(grid,)](
        x2,
        r2 if r2 is not None else x2,
        s if s is not None else y,
        y,
        weight,
        rstd if need_rstd else y,
        rows,
        width,
        x2.stride(0),
        r2.stride(0) if r2 is not None else 0,
        eps,
        offset,
        HAS_RESIDUAL=residual is not None,
        STORE_RSTD=need_rstd,
        CAST=CAST_MODES[cast],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    return s, y, rstd


def rms_backward(dy, ds, x_rows, weight, rstd, offset, cast, need_dw, config):
    dy2 = as_rows(dy)
    ds2 = as_rows(ds) if ds is not None else None
    rows, width = x_rows.shape
    dx = torch.empty_like(x_rows)
    block_n, block_m, warps, grid = _launch(width, rows, x_rows.device, config, "rms_norm", True)
    partial = torch.empty((grid, width), dtype=torch.float32, device=x_rows.device) if need_dw else dx
    launch(_rms_norm_bwd)[(grid,)](
        dy2,
        x_rows,
        weight,
        rstd,
        ds2 if ds2 is not None else dy2,
        dx,
        partial,
        rows,
        width,
        dy2.stride(0),
        ds2.stride(0) if ds2 is not None else 0,
        offset,
        HAS_DS=ds is not None,
        COMPUTE_DW=need_dw,
        CAST=CAST_MODES[cast],
        PREFETCH=(config or RowConfig()).prefetch,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    dw = partial.sum(0).to(weight.dtype) if need_dw else None
    return dx, dw


@triton.jit
def _layer_norm_fwd(
    X,
    Y,
    W,
    B,
    MEAN,
    RSTD,
    M,
    N,
    stride_x,
    eps,
    HAS_BIAS: tl.constexpr,
    STORE_STATS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        centred = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / N + eps)
        y = centred * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += b[None, :]
        tl.store(Y + rows64[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        if STORE_STATS:
            tl.store(MEAN + rows, mean, mask=row_mask)
            tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _layer_norm_bwd_loads(X, DY, MEAN, RSTD, tile, M, N, stride_dy, cols, col_mask, BLOCK_M: tl.constexpr):
    x, dy, rows, row_mask = _bwd_tile_loads(X, DY, tile, M, N, stride_dy, cols, col_mask, BLOCK_M)
    return x, dy, tl.load(MEAN + rows, mask=row_mask, other=0.0), tl.load(RSTD + rows, mask=row_mask, other=0.0)


@triton.jit
def _layer_norm_bwd(
    DY,
    X,
    W,
    MEAN,
    RSTD,
    DX,
    DW_PARTIAL,
    DB_PARTIAL,
    M,
    N,
    stride_dy,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    step = tl.num_programs(0)
    if PREFETCH:  # the next tile's loads are in flight while this one is reduced
        x_next, dy_next, mean_next, rstd_next = _layer_norm_bwd_loads(
            X, DY, MEAN, RSTD, pid, M, N, stride_dy, cols, col_mask, BLOCK_M
        )
    for tile in range(pid, tl.cdiv(M, BLOCK_M), step):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        if PREFETCH:
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            mean = mean_next
            rstd = rstd_next
            x_next, dy_next, mean_next, rstd_next = _layer_norm_bwd_loads(
                X, DY, MEAN, RSTD, tile + step, M, N, stride_dy, cols, col_mask, BLOCK_M
            )
        else:
            x, dy, mean, rstd = _layer_norm_bwd_loads(X, DY, MEAN, RSTD, tile, M, N, stride_dy, cols, col_mask, BLOCK_M)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w[None, :]
        c1 = tl.sum(xhat * wdy, axis=1) / N
        c2 = tl.sum(wdy, axis=1) / N
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + rows64[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw += tl.sum(dy * xhat, axis=0)
        if COMPUTE_DB:
            db += tl.sum(dy, axis=0)
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * N + cols, dw, mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB_PARTIAL + pid * N + cols, db, mask=col_mask)


def layer_norm_forward(x, weight, bias, eps, config, need_stats):
    check_float("x", x)
    width = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != width or (bias is not None and tuple(bias.shape) != (width,)):
        raise ValueError(f"weight/bias must have shape ({width},)")
    x2 = as_rows(x)
    rows = x2.shape[0]
    y = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device) if need_stats else None
    rstd = torch.empty_like(mean) if need_stats else None
    block_n, block_m, warps, grid = _launch(width, rows, x.device, config, "layer_norm", False)
    launch(_layer_norm_fwd)[(grid,)](
        x2,
        y,
        weight,
        bias if bias is not None else weight,
        mean if need_stats else y,
        rstd if need_stats else y,
        rows,
        width,
        x2.stride(0),
        eps,
        HAS_BIAS=bias is not None,
        STORE_STATS=need_stats,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    return x2, y, mean, rstd


def layer_norm_backward(dy, x_rows, weight, mean, rstd, need_dw, need_db, config):
    """(dx rows, fp32 dw, fp32 db); the weight and bias gradients are None when not asked for."""
    dy2 = as_rows(dy)
    rows, width = x_rows.shape
    dx = torch.empty_like(x_rows)
    block_n, block_m, warps, grid = _launch(width, rows, x_rows.device, config, "layer_norm", True)
    dw_partial = torch.empty((grid, width), dtype=torch.float32, device=dx.device) if need_dw else dx
    db_partial = torch.empty((grid, width), dtype=torch.float32, device=dx.device) if need_db else dx
    launch(_layer_norm_bwd)[(grid,)](
        dy2,
        x_rows,
        weight,
        mean,
        rstd,
        dx,
        dw_partial,
        db_partial,
        rows,
        width,
        dy2.stride(0),
        COMPUTE_DW=need_dw,
        COMPUTE_DB=need_db,
        PREFETCH=(config or RowConfig()).prefetch,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    return dx, dw_partial.sum(0) if need_dw else None, db_partial.sum(0) if need_db else None


def encode_config(config: RowConfig | None) -> list[int]:
    """A RowConfig as the integer list a torch.library operator takes (empty: the defaults)."""
    if config is None:
        return []
    per_sm = -1 if config.programs_per_sm is None else config.programs_per_sm
    return [config.block_m or 0, config.num_warps or 0, per_sm, int(config.prefetch)]


def decode_config(values: list[int]) -> RowConfig | None:
    if not values:
        return None
    block_m, num_warps, per_sm, prefetch = values
    return RowConfig(block_m or None, num_warps or None, None if per_sm < 0 else per_sm, bool(prefetch))
