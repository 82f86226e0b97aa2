"""``torch.library.opcheck`` of every adapt operator: schema, fake implementation against the real one,
autograd registration, and AOTAutograd with dynamic shapes through forward and backward."""

from __future__ import annotations

import pytest
import torch

from operators.kernels import moe_ops, ops, optim_ops  # noqa: F401  (they register torch.ops.adapt)

adapt = torch.ops.adapt


def leaf(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def moe_inputs(tokens=5, experts=4, top_k=2, width=8):
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    source, position, offsets = adapt.moe_sort(ids, experts)
    return ids, source, position, offsets


def cases():
    """(name, operator, args) with the smallest shapes that still cover strided and optional arguments."""
    x, w, b = leaf(3, 2, 24), leaf(24), leaf(24)
    rows = torch.randn(6, 24)
    rstd = torch.rand(6) + 0.5
    q, k = leaf(2, 4, 5, 12), leaf(2, 2, 5, 12)
    angles = torch.rand(1, 5, 4) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    hidden, head, labels = leaf(6, 16), leaf(40, 16), torch.randint(0, 40, (6,))
    labels[1] = -100
    ids, source, position, offsets = moe_inputs()
    expert_rows = leaf(10, 8)
    bank = leaf(4, 12, 8).transpose(1, 2)  # [E, K=8, N=12] as a transposed view, as the MoE patch passes it
    yield "rms_norm", adapt.rms_norm, (x, w, 1e-6, 1.0, "scale_then_round", [], True)
    yield (
        "rms_norm/inference",
        adapt.rms_norm,
        (x.detach(), w.detach(), 1e-6, 0.0, "round_then_scale", [2, 4, -1, 1], False),
    )
    yield "add_rms_norm", adapt.add_rms_norm, (x, leaf(3, 2, 24), w, 1e-6, 0.0, "round_then_scale", [], True)
    yield (
        "rms_norm_backward",
        adapt.rms_norm_backward,
        (rows, rows.clone(), rows.clone(), w.detach(), rstd, 0.0, "activation_dtype", True, []),
    )
    yield "layer_norm", adapt.layer_norm, (x, w, b, 1e-5, [], True)
    yield "layer_norm/no bias", adapt.layer_norm, (x, w, None, 1e-5, [], True)
    yield (
        "layer_norm_backward",
        adapt.layer_norm_backward,
        (rows, rows.clone(), w.detach(), b.detach(), torch.randn(6), rstd, True, True, []),
    )
    gate_up = leaf(3, 32)
    yield "glu/strided halves", adapt.glu, (gate_up[:, :16], gate_up[:, 16:], "gelu_tanh")
    yield "glu_backward", adapt.glu_backward, (torch.randn(3, 16), torch.randn(3, 16), torch.randn(3, 16), "silu")
    yield "glu_linear", adapt.glu_linear, (leaf(2, 3, 16), leaf(2, 3, 16), leaf(8, 16), leaf(8), "silu")
    yield "glu_linear/strided halves", adapt.glu_linear, (gate_up[:, :16], gate_up[:, 16:], leaf(8, 16), None, "gelu")
    yield (
        "glu_linear_backward",
        adapt.glu_linear_backward,
        (
            torch.randn(2, 3, 8),
            torch.randn(2, 3, 16),
            torch.randn(2, 3, 16),
            torch.randn(8, 16),
            "gelu_tanh",
            True,
            True,
        ),
    )
    yield "apply_rotary", adapt.apply_rotary, (q, k, cos, sin, False, 8)
    yield "apply_rotary/hf layout", adapt.apply_rotary, (leaf(2, 5, 4, 12).transpose(1, 2), k, cos, sin, True, 8)
    yield (
        "apply_rotary_backward",
        adapt.apply_rotary_backward,
        (torch.randn(2, 4, 5, 12), torch.randn(2, 2, 5, 12), cos, sin, False, 8, [240, 60, 12, 1], [120, 60, 12, 1]),
    )
    yield (
        "fused_linear_cross_entropy/mean",
        adapt.fused_linear_cross_entropy,
        (hidden, head, labels, None, -100, 0.1, 1e-4, 30.0, "mean", 4, True, True, False),
    )
    yield (
        "fused_linear_cross_entropy/none+bias",
        adapt.fused_linear_cross_entropy,
        (hidden, head, labels, leaf(40), -100, 0.0, 0.0, None, "none", None, True, True, True),
    )
    yield (
        "fused_linear_cross_entropy_backward",
        adapt.fused_linear_cross_entropy_backward,
        (
            torch.randn(6),
            hidden.detach(),
            head.detach(),
            labels,
            torch.randn(40),
            -100,
            0.0,
            0.0,
            None,
            None,
            True,
            True,
            True,
        ),
    )
    yield "moe_route", adapt.moe_route, (leaf(5, 8), 2, "sigmoid", 2, 1, True, torch.randn(8), 1.5)
    yield (
        "moe_route_backward",
        adapt.moe_route_backward,
        (torch.randn(5, 2), torch.randn(5, 4), ids, 2, "softmax", True, 1.0),
    )
    yield "moe_sort", adapt.moe_sort, (ids, 4)
    yield "moe_permute", adapt.moe_permute, (leaf(5, 8), source, position)
    yield "moe_combine", adapt.moe_combine, (torch.randn(10, 8), position)
    yield "moe_unpermute", adapt.moe_unpermute, (expert_rows, torch.rand(5, 2).requires_grad_(), position)
    yield (
        "moe_unpermute_backward",
        adapt.moe_unpermute_backward,
        (torch.randn(5, 8), torch.randn(10, 8), torch.rand(5, 2), position),
    )
    yield "grouped_gemm", adapt.grouped_gemm, (leaf(10, 8), bank, offsets, [])
    yield (
        "grouped_gemm_backward",
        adapt.grouped_gemm_backward,
        (torch.randn(10, 12), torch.randn(10, 8), bank.detach(), offsets, True, True, []),
    )
    shapes = (7, 5), (3,)
    params, grads = [torch.randn(s) for s in shapes], [torch.randn(s) for s in shapes]
    moments = [torch.randn(s) for s in shapes], [torch.rand(s) for s in shapes]
    yield "adamw_update_", adapt.adamw_update_, (params, grads, *moments, [3, 1], 1e-3, 0.9, 0.99, 1e-8, 0.1)


CASES = list(cases())


@pytest.mark.parametrize("name, op, args", CASES, ids=[c[0] for c in CASES])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


def test_every_adapt_operator_is_checked():
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("adapt::")}
    checked = {case[0].split("/")[0] for case in CASES}
    assert len(registered) >= 20 and registered == checked, registered ^ checked
