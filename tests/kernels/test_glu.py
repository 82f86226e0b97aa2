"""SwiGLU and GeGLU (exact and tanh GELU) against float64 references, forward and both gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, assert_close, leaf, ref_leaf

from operators.kernels import geglu, swiglu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VARIANTS = {
    "swiglu": (lambda g, u: swiglu(g, u), lambda g, u: F.silu(g) * u),
    "geglu": (lambda g, u: geglu(g, u), lambda g, u: F.gelu(g) * u),
    "geglu_tanh": (lambda g, u: geglu(g, u, approximate="tanh"), lambda g, u: F.gelu(g, approximate="tanh") * u),
}


def _check(variant, gate_in, up_in, dtype):
    kernel, reference = VARIANTS[variant]
    g, u = leaf(gate_in), leaf(up_in)
    g64, u64 = ref_leaf(gate_in), ref_leaf(up_in)
    y = kernel(g, u)
    ref = reference(g64, u64)
    assert y.dtype == gate_in.dtype and y.shape == gate_in.shape
    assert_close(y, ref, dtype, what="y")
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    assert_close(g.grad, g64.grad, dtype, scale=2, what="dgate")
    assert_close(u.grad, u64.grad, dtype, scale=2, what="dup")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_glu_odd_shape(variant, dtype):
    shape = (3, 5, 123)
    _check(
        variant,
        torch.randn(shape, device=DEVICE, dtype=dtype) * 3,
        torch.randn(shape, device=DEVICE, dtype=dtype),
        dtype,
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_glu_halves_of_fused_projection(variant):
    """gate/up as the two row-strided halves of a fused gate_up output are read in place."""
    fused = torch.randn(4, 9, 2 * 300, device=DEVICE, dtype=torch.bfloat16) * 2
    gate, up = fused.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    _check(variant, gate, up, torch.bfloat16)


def test_swiglu_real_width_mixed_layout():
    gate = torch.randn(2, 14336, device=DEVICE, dtype=torch.bfloat16) * 3
    up = torch.randn(14336, 2, device=DEVICE, dtype=torch.bfloat16).t()  # inner dim strided: copied
    _check("swiglu", gate, up, torch.bfloat16)


def test_glu_rejects_mismatch():
    with pytest.raises(ValueError):
        swiglu(torch.randn(2, 3, device=DEVICE), torch.randn(2, 4, device=DEVICE))
    with pytest.raises(ValueError):
        geglu(torch.randn(2, 3, device=DEVICE), torch.randn(2, 3, device=DEVICE), approximate="erf")
