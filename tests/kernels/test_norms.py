"""RMSNorm, fused add + RMSNorm and LayerNorm against float64 references, forward and every gradient."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, assert_close, leaf, ref_leaf, round_to

from operators.kernels import RowConfig, add_rms_norm, layer_norm, rms_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference_rms_norm(x, w, eps, offset, cast, dtype):
    """float64 RMSNorm with the rounding points of each casting order."""
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if cast == "round_then_scale":
        return round_to(x * rstd, dtype) * (offset + w)
    if cast == "scale_then_round":
        return x * rstd * (offset + w)
    return round_to(x * round_to(rstd, dtype), dtype) * round_to(offset + w, dtype)


def _check_rms(x_in, w_in, offset, cast, dtype, eps=1e-6, config=None):
    x, w = leaf(x_in), leaf(w_in)
    x64, w64 = ref_leaf(x_in), ref_leaf(w_in)
    y = rms_norm(x, w, eps=eps, offset=offset, cast=cast, config=config)
    ref = reference_rms_norm(x64, w64, eps, offset, cast, dtype)
    assert y.dtype == x_in.dtype and y.shape == x_in.shape
    assert_close(y, ref, dtype, what="y")
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.to(torch.float64))
    assert_close(x.grad, x64.grad, dtype, scale=2, what="dx")
    assert_close(w.grad, w64.grad, dtype, scale=2, what="dw")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cast", ["round_then_scale", "scale_then_round", "activation_dtype"])
def test_rms_norm_odd_shape(dtype, cast):
    offset = 1.0 if cast == "scale_then_round" else 0.0
    x = torch.randn(3, 5, 123, device=DEVICE, dtype=dtype)
    w = (torch.randn(123, device=DEVICE) * 0.3 + (0.0 if offset else 1.0)).to(dtype)
    _check_rms(x, w, offset, cast, dtype)


def test_rms_norm_non_contiguous_rows_and_fp32_weight():
    base = torch.randn(7, 200, device=DEVICE, dtype=torch.bfloat16)
    x = base[:, 10:133]  # row-strided view, width 123
    assert not x.is_contiguous()
    w = torch.randn(123, device=DEVICE, dtype=torch.float32)
    _check_rms(x, w, 0.0, "round_then_scale", torch.bfloat16)
    transposed = torch.randn(123, 6, device=DEVICE, dtype=torch.float16).t()  # inner dim strided
    _check_rms(transposed, torch.randn(123, device=DEVICE, dtype=torch.float16), 0.5, "scale_then_round", torch.float16)


@pytest.mark.parametrize("prefetch", [True, False])
def test_persistent_loops_cover_every_tile(prefetch):
    """More tiles than programs: each program loops (and prefetches past the last tile, masked)."""
    config = RowConfig(block_m=2, num_warps=4, programs_per_sm=1, prefetch=prefetch)
    x = torch.randn(4, 9, 40, device=DEVICE, dtype=torch.float16)  # 36 rows -> 18 tiles
    _check_rms(
        x, torch.randn(40, device=DEVICE, dtype=torch.float16), 0.0, "round_then_scale", torch.float16, config=config
    )
    x_in, w_in, b_in = (
        torch.randn(37, 40, device=DEVICE),
        torch.randn(40, device=DEVICE),
        torch.randn(40, device=DEVICE),
    )
    x, w, b = leaf(x_in), leaf(w_in), leaf(b_in)
    x64, w64, b64 = ref_leaf(x_in), ref_leaf(w_in), ref_leaf(b_in)
    y = layer_norm(x, w, b, config=config)
    ref = reference_layer_norm(x64, w64, b64, 1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    for ours, theirs in ((y, ref), (x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert_close(ours, theirs, torch.float32, scale=2)


def test_rms_norm_real_width():
    x = torch.randn(2, 4096, device=DEVICE, dtype=torch.bfloat16) * 3
    _check_rms(
        x, torch.randn(4096, device=DEVICE, dtype=torch.bfloat16), 0.0, "round_then_scale", torch.bfloat16, eps=1e-5
    )


def test_rms_norm_without_grad_matches():
    x = torch.randn(4, 33, device=DEVICE)
    w = torch.randn(33, device=DEVICE)
    y = rms_norm(x, w)
    assert y.grad_fn is None
    assert_close(
        y, reference_rms_norm(x.double(), w.double(), 1e-6, 0.0, "round_then_scale", torch.float32), torch.float32
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cast", ["round_then_scale", "scale_then_round"])
def test_add_rms_norm(dtype, cast):
    shape = (2, 7, 77)
    x_in = torch.randn(shape, device=DEVICE, dtype=dtype)
    r_in = torch.randn(shape, device=DEVICE, dtype=dtype)
    w_in = torch.randn(77, device=DEVICE, dtype=dtype)
    offset = 1.0 if cast == "scale_then_round" else 0.0
    x, r, w = leaf(x_in), leaf(r_in), leaf(w_in)
    x64, r64, w64 = ref_leaf(x_in), ref_leaf(r_in), ref_leaf(w_in)
    total, normed = add_rms_norm(x, r, w, eps=1e-5, offset=offset, cast=cast)
    ref_total = round_to(x64 + r64, dtype)
    ref_normed = reference_rms_norm(ref_total, w64, 1e-5, offset, cast, dtype)
    assert_close(total, ref_total, dtype, what="sum")
    assert_close(normed, ref_normed, dtype, what="normed")
    d_total, d_normed = torch.randn_like(total), torch.randn_like(normed)
    torch.autograd.backward([total, normed], [d_total, d_normed])
    torch.autograd.backward([ref_total, ref_normed], [d_total.double(), d_normed.double()])
    assert_close(x.grad, x64.grad, dtype, scale=2, what="dx")
    assert_close(r.grad, r64.grad, dtype, scale=2, what="dresidual")
    assert_close(w.grad, w64.grad, dtype, scale=2, what="dw")


def reference_layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps) * w
    return y + b if b is not None else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm(dtype, with_bias):
    x_in = torch.randn(3, 5, 123, device=DEVICE, dtype=dtype) * 2 + 0.5
    w_in = torch.randn(123, device=DEVICE, dtype=dtype)
    b_in = torch.randn(123, device=DEVICE, dtype=dtype) if with_bias else None
    x, w = leaf(x_in), leaf(w_in)
    b = leaf(b_in) if with_bias else None
    x64, w64 = ref_leaf(x_in), ref_leaf(w_in)
    b64 = ref_leaf(b_in) if with_bias else None
    y = layer_norm(x, w, b, eps=1e-5)
    ref = reference_layer_norm(x64, w64, b64, 1e-5)
    assert_close(y, ref, dtype, what="y")
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    assert_close(x.grad, x64.grad, dtype, scale=2, what="dx")
    assert_close(w.grad, w64.grad, dtype, scale=2, what="dw")
    if with_bias:
        assert_close(b.grad, b64.grad, dtype, scale=2, what="db")


def test_layer_norm_real_width_strided():
    base = torch.randn(3, 2 * 2048, device=DEVICE, dtype=torch.bfloat16)
    x_in = base[:, ::2]  # inner-strided: copied once, still correct
    w_in, b_in = (
        torch.randn(2048, device=DEVICE, dtype=torch.bfloat16),
        torch.randn(2048, device=DEVICE, dtype=torch.bfloat16),
    )
    x, w, b = leaf(x_in), leaf(w_in), leaf(b_in)
    x64, w64, b64 = ref_leaf(x_in), ref_leaf(w_in), ref_leaf(b_in)
    y = layer_norm(x, w, b)
    ref = reference_layer_norm(x64, w64, b64, 1e-5)
    assert_close(y, ref, torch.bfloat16)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    assert_close(x.grad, x64.grad, torch.bfloat16, scale=2)


def test_bad_cast_mode_is_rejected():
    with pytest.raises(ValueError, match="cast"):
        rms_norm(torch.randn(2, 8, device=DEVICE), torch.randn(8, device=DEVICE), cast="fp8")
