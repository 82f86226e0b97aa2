"""SwiGLU and GeGLU (exact and tanh GELU), alone and fused with the projection after them, against float64
references, forward and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, assert_close, leaf, ref_leaf

from operators.kernels import geglu, glu_linear, swiglu

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


ACTIVATION_REFERENCES = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", sorted(ACTIVATION_REFERENCES))
@pytest.mark.parametrize("bias", [False, True])
def test_glu_linear_matches_the_unit_then_the_projection(activation, dtype, bias):
    """Forward and the gradients of gate, up, weight and bias; gate/up as halves of a fused projection."""
    fused = torch.randn(3, 5, 2 * 96, device=DEVICE, dtype=dtype) * 2
    gate_in, up_in = fused.chunk(2, dim=-1)
    w_in = (torch.randn(40, 96, device=DEVICE) / 96**0.5).to(dtype)
    b_in = torch.randn(40, device=DEVICE, dtype=dtype) if bias else None
    g, u, w = leaf(gate_in), leaf(up_in), leaf(w_in)
    g64, u64, w64 = ref_leaf(gate_in), ref_leaf(up_in), ref_leaf(w_in)
    b, b64 = (leaf(b_in), ref_leaf(b_in)) if bias else (None, None)
    out = glu_linear(g, u, w, b, activation)
    ref = F.linear(ACTIVATION_REFERENCES[activation](g64) * u64, w64, b64)
    assert_close(out, ref, dtype, scale=2, what="out")
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    for name, got, want in [("dgate", g, g64), ("dup", u, u64), ("dweight", w, w64)] + (
        [("dbias", b, b64)] if bias else []
    ):
        assert_close(got.grad, want.grad, dtype, scale=3, what=name)


def test_glu_linear_keeps_gate_and_up_but_not_their_product():
    """What autograd saves for the backward: the unit's output (as large as gate) is not among it."""
    gate = torch.randn(64, 48, device=DEVICE, requires_grad=True)
    up = torch.randn(64, 48, device=DEVICE, requires_grad=True)
    down = torch.nn.Linear(48, 16, device=DEVICE)

    def saved_elements(fn) -> int:
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            fn()
        return sum(sizes) - down.weight.numel()  # the weight is saved either way (a reference, no memory)

    fused = saved_elements(lambda: glu_linear(gate, up, down.weight, down.bias, "silu"))
    unfused = saved_elements(lambda: down(swiglu(gate, up)))
    assert fused == 2 * gate.numel() and unfused == 3 * gate.numel()


def test_glu_linear_frozen_projection_takes_no_weight_gradient():
    gate = torch.randn(8, 12, device=DEVICE, requires_grad=True)
    up = torch.randn(8, 12, device=DEVICE, requires_grad=True)
    weight = torch.randn(5, 12, device=DEVICE)
    glu_linear(gate, up, weight, None, "gelu").sum().backward()
    assert weight.grad is None and gate.grad is not None and torch.isfinite(up.grad).all()


def test_glu_linear_rejects_mismatch():
    g = torch.randn(2, 3, device=DEVICE)
    with pytest.raises(ValueError):
        glu_linear(g, g, torch.randn(4, 5, device=DEVICE), None, "silu")
    with pytest.raises(ValueError):
        glu_linear(g, g, torch.randn(4, 3, device=DEVICE), None, "relu")
