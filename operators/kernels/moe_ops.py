"""adapt's MoE kernels as ``torch.library`` operators: routing, the sort by expert, permute, grouped GEMM
and the weighted unpermute, each with a fake implementation and (where differentiable) autograd.

Output shapes never depend on the routing: ``T * top_k`` sorted rows and ``E + 1`` offsets are known
from the input shapes, so no unbacked sizes enter a traced graph.  See ``ops`` for the conventions.
"""

from __future__ import annotations

import torch
from torch.library import custom_op, register_autograd

from . import gemm, moe
from ._op_utils import CALLS, no_gradient, none_if_empty


@custom_op("adapt::moe_route", mutates_args=())
def moe_route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    n_group: int,
    topk_group: int,
    normalize: bool,
    correction_bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights ``[T, k]``, int64 expert ids ``[T, k]``) from row-major router logits ``[T, E]``."""
    CALLS["moe_route"] += 1
    return moe.route_forward(logits, top_k, scoring, n_group, topk_group, normalize, correction_bias, scale)


@moe_route.register_fake
def _(logits, top_k, scoring, n_group, topk_group, normalize, correction_bias, scale):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


@custom_op("adapt::moe_route_backward", mutates_args=())
def moe_route_backward(
    dweights: torch.Tensor,
    logits: torch.Tensor,
    ids: torch.Tensor,
    top_k: int,
    scoring: str,
    normalize: bool,
    scale: float,
) -> torch.Tensor:
    CALLS["moe_route_backward"] += 1
    return moe.route_backward(dweights, logits, ids, top_k, scoring, normalize, scale)


@moe_route_backward.register_fake
def _(dweights, logits, ids, top_k, scoring, normalize, scale):
    return logits.new_empty(logits.shape)


def _route_setup(ctx, inputs, output):
    logits, top_k, scoring, _, _, normalize, _, scale = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.meta = (top_k, scoring, normalize, scale)


def _route_grad(ctx, dweights, _dids):
    logits, ids = ctx.saved_tensors
    dlogits = torch.ops.adapt.moe_route_backward(dweights, logits, ids, *ctx.meta)
    return dlogits, None, None, None, None, None, None, None


register_autograd("adapt::moe_route", _route_grad, setup_context=_route_setup)


@custom_op("adapt::moe_sort", mutates_args=())
def moe_sort(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source token per sorted row ``[T*k]``, sorted row per (token, slot) ``[T, k]``, offsets ``[E + 1]``).

    One operator so that the data-dependent checks (ids in range) run with the kernel, compiled or not.
    """
    CALLS["moe_sort"] += 1
    source, position, offsets = moe.sort_by_expert(expert_ids, num_experts)
    return source, position, offsets


@moe_sort.register_fake
def _(expert_ids, num_experts):
    return (
        expert_ids.new_empty(expert_ids.numel()),
        expert_ids.new_empty(expert_ids.shape),
        expert_ids.new_empty(num_experts + 1),
    )


@custom_op("adapt::moe_permute", mutates_args=())
def moe_permute(x: torch.Tensor, source_token: torch.Tensor, sorted_position: torch.Tensor) -> torch.Tensor:
    """Row ``r`` of the result is ``x[source_token[r]]`` (``sorted_position`` is kept for the backward)."""
    CALLS["moe_permute"] += 1
    return moe.gather(x, source_token)


@moe_permute.register_fake
def _(x, source_token, sorted_position):
    return x.new_empty((source_token.shape[0], x.shape[1]))


@custom_op("adapt::moe_combine", mutates_args=())
def moe_combine(y: torch.Tensor, sorted_position: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k y[sorted_position[t, k]]``: the permutation's backward."""
    CALLS["moe_combine"] += 1
    return moe.combine(y.contiguous(), sorted_position, None, *sorted_position.shape)


@moe_combine.register_fake
def _(y, sorted_position):
    return y.new_empty((sorted_position.shape[0], y.shape[1]))


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _permute_grad(ctx, dout):
    (sorted_position,) = ctx.saved_tensors
    return torch.ops.adapt.moe_combine(dout, sorted_position), None, None


register_autograd("adapt::moe_permute", _permute_grad, setup_context=_permute_setup)


@custom_op("adapt::moe_unpermute", mutates_args=())
def moe_unpermute(y_sorted: torch.Tensor, weights: torch.Tensor, sorted_position: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * y_sorted[sorted_position[t, k]]`` in ``y_sorted``'s dtype."""
    CALLS["moe_unpermute"] += 1
    return moe.combine(y_sorted, sorted_position, weights, *sorted_position.shape)


@moe_unpermute.register_fake
def _(y_sorted, weights, sorted_position):
    return y_sorted.new_empty((sorted_position.shape[0], y_sorted.shape[1]))


@custom_op("adapt::moe_unpermute_backward", mutates_args=())
def moe_unpermute_backward(
    dy: torch.Tensor, y_sorted: torch.Tensor, weights: torch.Tensor, sorted_position: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    CALLS["moe_unpermute_backward"] += 1
    return moe.unpermute_backward(dy, y_sorted, weights, sorted_position)


@moe_unpermute_backward.register_fake
def _(dy, y_sorted, weights, sorted_position):
    return y_sorted.new_empty(y_sorted.shape), torch.empty_like(weights)


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unpermute_grad(ctx, dy):
    y_sorted, weights, sorted_position = ctx.saved_tensors
    dy_sorted, dweights = torch.ops.adapt.moe_unpermute_backward(dy, y_sorted, weights, sorted_position)
    return dy_sorted, dweights, None


register_autograd("adapt::moe_unpermute", _unpermute_grad, setup_context=_unpermute_setup)


@custom_op("adapt::grouped_gemm", mutates_args=())
def grouped_gemm_op(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, config: list[int]) -> torch.Tensor:
    """``x[rows of e] @ w[e]`` for every expert ``e``; ``config`` is ``gemm.encode_config``'s list."""
    CALLS["grouped_gemm"] += 1
    return gemm.grouped_mm(x, w, group_offsets, False, gemm.decode_config(config))


@grouped_gemm_op.register_fake
def _(x, w, group_offsets, config):
    return x.new_empty((x.shape[0], w.shape[2]))


@custom_op("adapt::grouped_gemm_backward", mutates_args=())
def grouped_gemm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
    config: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx or empty, dw in ``w``'s layout or empty)."""
    CALLS["grouped_gemm_backward"] += 1
    launch = gemm.decode_config(config)
    dy = dy.contiguous()
    dx = gemm.grouped_mm(dy, w, group_offsets, True, launch) if need_dx else no_gradient(x)
    dw = gemm.grouped_weight_grad(x, dy, w, group_offsets, launch) if need_dw else no_gradient(w)
    return dx, dw


@grouped_gemm_backward.register_fake
def _(dy, x, w, group_offsets, need_dx, need_dw, config):
    return x.new_empty(x.shape if need_dx else (0,)), torch.empty_like(w) if need_dw else w.new_empty(0)


def _gemm_setup(ctx, inputs, output):
    x, w, group_offsets, config = inputs
    ctx.save_for_backward(x, w, group_offsets)
    ctx.config = config


def _gemm_grad(ctx, dy):
    x, w, group_offsets = ctx.saved_tensors
    dx, dw = torch.ops.adapt.grouped_gemm_backward(
        dy, x, w, group_offsets, ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.config
    )
    return none_if_empty(dx), none_if_empty(dw), None, None


register_autograd("adapt::grouped_gemm", _gemm_grad, setup_context=_gemm_setup)
