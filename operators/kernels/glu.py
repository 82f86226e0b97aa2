"""Gated linear units: ``act(gate) * up`` for SiLU (SwiGLU) and exact / tanh GELU (GeGLU).

The forward streams gate and up once and writes the product once (three tensors, no stored
activations); the backward recomputes the activation from the saved inputs, and can write the product
again from the same loads, so that a down projection fused behind the unit need not keep it (``ops.glu_linear``). Contiguous inputs are
treated as one flat vector so every program moves a full, aligned block; row-strided inputs (for
example the two halves of a fused gate_up projection) are read in place through their row stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._registration import launch
from ._utils import cdiv, check_float, next_pow2

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))  # never overflows
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr, NEED_GRAD: tl.constexpr):
    """Activation value and (optionally) its derivative, both in fp32.

    Constants are literals: sqrt(2/pi) = 0.79788456, 1/sqrt(2) = 0.70710678, 1/sqrt(2 pi) = 0.39894228.
    """
    if ACT == 0:
        sig = tl.sigmoid(g)
        value = g * sig
        grad = sig * (1.0 + g * (1.0 - sig)) if NEED_GRAD else value
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        value = g * cdf
        grad = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g) if NEED_GRAD else value
    else:
        t = _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))
        value = 0.5 * g * (1.0 + t)
        if NEED_GRAD:
            grad = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        else:
            grad = value
    return value, grad


@triton.jit
def _glu_fwd(G, U, Y, N, stride_g, stride_u, ACT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(N, BLOCK)
    row = (pid // col_blocks).to(tl.int64)
    cols = (pid % col_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(g, ACT, False)
    tl.store(Y + row * N + cols, (act * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd(
    DY, G, U, DG, DU, Y, N, stride_dy, stride_g, stride_u, ACT: tl.constexpr, STORE_Y: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(N, BLOCK)
    row = (pid // col_blocks).to(tl.int64)
    cols = (pid % col_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(g, ACT, True)
    tl.store(DG + row * N + cols, (dy * u * dact).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * N + cols, (dy * act).to(DU.dtype.element_ty), mask=mask)
    if STORE_Y:  # the forward's output again, from the same loads (for a following GEMM's weight gradient)
        tl.store(Y + row * N + cols, (act * u).to(Y.dtype.element_ty), mask=mask)


def _row_view(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with unit column stride, without a copy when its rows are evenly strided."""
    if t.stride(-1) == 1:
        try:
            return t.view(-1, width)
        except RuntimeError:
            pass
    return t.contiguous().view(-1, width)


def _layout(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], int, int, list[int]]:
    """A common (rows, width, row strides) walk: one flat row when all operands are contiguous."""
    if all(t.is_contiguous() for t in tensors):
        n = tensors[0].numel()
        return list(tensors), 1, n, [n] * len(tensors)
    width = tensors[0].shape[-1]
    rows = [_row_view(t, width) for t in tensors]
    return rows, rows[0].shape[0], width, [r.stride(0) for r in rows]


def _block(width: int) -> tuple[int, int]:
    """(BLOCK, num_warps): 4096-element blocks, 8 warps. On H200 this ran SwiGLU and GeGLU at 100% of copy
    bandwidth; 2048-element blocks were within 1% for SwiGLU but 11% slower for tanh-GeGLU (NOTES-kernels.md)."""
    block = 4096 if width >= 4096 else next_pow2(max(width, 16))  # a symbolic width of 4096+ stays symbolic
    return block, max(1, min(8, block // 512))


def glu_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    check_float("gate", gate)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} must match")
    (g, u), rows, width, (sg, su) = _layout(gate, up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block, warps = _block(width)
    if y.numel():
        launch(_glu_fwd)[(rows * cdiv(width, block),)](
            g, u, y, width, sg, su, ACT=ACTIVATIONS[activation], BLOCK=block, num_warps=warps
        )
    return y


def glu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, recompute: bool = False):
    """(d gate, d up, and with ``recompute`` the forward's output, else None), recomputing the activation from
    the saved inputs."""
    (d, g, u), rows, width, (sd, sg, su) = _layout(dy, gate, up)
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty_like(dgate)
    y = torch.empty_like(dgate) if recompute else None
    block, warps = _block(width)
    if dgate.numel():
        launch(_glu_bwd)[(rows * cdiv(width, block),)](
            d,
            g,
            u,
            dgate,
            dup,
            y if recompute else dgate,
            width,
            sd,
            sg,
            su,
            ACT=ACTIVATIONS[activation],
            STORE_Y=recompute,
            BLOCK=block,
            num_warps=warps,
        )
    return dgate, dup, y
