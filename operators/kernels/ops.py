"""adapt's kernels as ``torch.library`` operators in the ``adapt`` namespace.

Each operator has a real implementation (the Triton launch code beside the kernels), a fake one that
only allocates outputs of the right shape, dtype and layout, and, for the forward operators, autograd
whose backward is itself an ``adapt`` operator.  Dynamo, AOTAutograd and ``torch.export`` therefore
see every kernel as one node, forward and backward, instead of tracing into Triton launch code.

The operators are ``custom_op`` (opaque to Inductor): ``triton_op`` cannot run its fake pass on
kernels built for Triton's CPU interpreter, and one registration must serve CUDA and the interpreter.
Statistics a backward needs (row ``rstd``, precomputed loss gradients) are extra outputs, because
autograd's ``setup_context`` can only save inputs and outputs.  Where a gradient is not asked for, its
output is an empty tensor.  ``CALLS`` counts real executions per operator: it advances when a kernel
really runs, eager or compiled, never while a graph is traced.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.library import custom_op, register_autograd

from . import cross_entropy, glu, grouped_gemm, moe, norms, rope
from ._utils import as_rows

CALLS: Counter[str] = Counter()  # adapt operator name -> real (non-fake) executions


def _none_if_empty(t: torch.Tensor) -> torch.Tensor | None:
    return t if t.numel() else None


def _nothing(like: torch.Tensor) -> torch.Tensor:
    """The placeholder output of a gradient nobody asked for."""
    return like.new_empty(0)


# ---------------------------------------------------------------- RMSNorm and residual-add + RMSNorm


@custom_op("adapt::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast: str, config: list[int],
             store_rstd: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, fp32 row rstd or empty); ``config`` is ``norms.encode_config``'s list."""
    CALLS["rms_norm"] += 1
    _, y, rstd = norms.rms_forward(x, None, weight, eps, offset, cast, norms.decode_config(config), store_rstd)
    return y.view(x.shape), rstd if store_rstd else _nothing(y).float()


@rms_norm.register_fake
def _(x, weight, eps, offset, cast, config, store_rstd):
    rows = x.numel() // x.shape[-1] if store_rstd else 0
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32)


@custom_op("adapt::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast: str,
                 config: list[int], store_rstd: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm, fp32 row rstd or empty) in one pass."""
    CALLS["add_rms_norm"] += 1
    s, y, rstd = norms.rms_forward(x, residual, weight, eps, offset, cast, norms.decode_config(config), store_rstd)
    return s.view(x.shape), y.view(x.shape), rstd if store_rstd else _nothing(y).float()


@add_rms_norm.register_fake
def _(x, residual, weight, eps, offset, cast, config, store_rstd):
    rows = x.numel() // x.shape[-1] if store_rstd else 0
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32)


@custom_op("adapt::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: torch.Tensor, dsum: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor, offset: float, cast: str, need_dw: bool,
                      config: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight or empty); ``dsum`` is the gradient reaching the residual sum directly (fused add)."""
    CALLS["rms_norm_backward"] += 1
    if rstd.numel() == 0:
        raise RuntimeError("adapt::rms_norm_backward needs the forward's rstd (run the forward with store_rstd)")
    x_rows = as_rows(x).contiguous()
    dx, dw = norms.rms_backward(dy, dsum, x_rows, weight, rstd, offset, cast, need_dw, norms.decode_config(config))
    return dx.view(x.shape), dw if need_dw else _nothing(weight)


@rms_norm_backward.register_fake
def _(dy, dsum, x, weight, rstd, offset, cast, need_dw, config):
    return x.new_empty(x.shape), weight.new_empty(weight.shape if need_dw else (0,))


def _rms_setup(ctx, inputs, output):
    x, weight, _, offset, cast, config, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.meta = (offset, cast, config)


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    offset, cast, config = ctx.meta
    dx, dw = torch.ops.adapt.rms_norm_backward(dy, None, x, weight, rstd, offset, cast, ctx.needs_input_grad[1], config)
    return dx, _none_if_empty(dw), None, None, None, None, None


register_autograd("adapt::rms_norm", _rms_backward, setup_context=_rms_setup)


def _add_rms_setup(ctx, inputs, output):
    _, _, weight, _, offset, cast, config, _ = inputs
    ctx.save_for_backward(output[0], weight, output[2])
    ctx.meta = (offset, cast, config)


def _add_rms_backward(ctx, dsum, dy, _drstd):
    total, weight, rstd = ctx.saved_tensors
    offset, cast, config = ctx.meta
    dx, dw = torch.ops.adapt.rms_norm_backward(dy, dsum, total, weight, rstd, offset, cast, ctx.needs_input_grad[2],
                                               config)
    return dx, dx, _none_if_empty(dw), None, None, None, None, None


register_autograd("adapt::add_rms_norm", _add_rms_backward, setup_context=_add_rms_setup)


# ---------------------------------------------------------------- LayerNorm


@custom_op("adapt::layer_norm", mutates_args=())
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, config: list[int],
               store_stats: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, fp32 row mean, fp32 row rstd); the statistics are empty unless ``store_stats``."""
    CALLS["layer_norm"] += 1
    _, y, mean, rstd = norms.layer_norm_forward(x, weight, bias, eps, norms.decode_config(config), store_stats)
    if not store_stats:
        mean, rstd = _nothing(y).float(), _nothing(y).float()
    return y.view(x.shape), mean, rstd


@layer_norm.register_fake
def _(x, weight, bias, eps, config, store_stats):
    rows = x.numel() // x.shape[-1] if store_stats else 0
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@custom_op("adapt::layer_norm_backward", mutates_args=())
def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        mean: torch.Tensor, rstd: torch.Tensor, need_dw: bool, need_db: bool,
                        config: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight or empty, dbias or empty)."""
    CALLS["layer_norm_backward"] += 1
    need_db = need_db and bias is not None
    x_rows = as_rows(x).contiguous()
    dx, dw, db = norms.layer_norm_backward(dy, x_rows, weight, mean, rstd, need_dw, need_db,
                                           norms.decode_config(config))
    return (dx.view(x.shape), dw.to(weight.dtype) if need_dw else _nothing(weight),
            db.to(bias.dtype) if need_db else _nothing(weight))


@layer_norm_backward.register_fake
def _(dy, x, weight, bias, mean, rstd, need_dw, need_db, config):
    need_db = need_db and bias is not None
    return (x.new_empty(x.shape), weight.new_empty(weight.shape if need_dw else (0,)),
            (bias if need_db else weight).new_empty(bias.shape if need_db else (0,)))


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, _, config, _ = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.config = config


def _layer_norm_grad(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.adapt.layer_norm_backward(dy, x, weight, bias, mean, rstd, ctx.needs_input_grad[1],
                                                     ctx.needs_input_grad[2], ctx.config)
    return dx, _none_if_empty(dw), _none_if_empty(db), None, None, None


register_autograd("adapt::layer_norm", _layer_norm_grad, setup_context=_layer_norm_setup)


# ---------------------------------------------------------------- gated linear units


@custom_op("adapt::glu", mutates_args=())
def glu_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` with ``activation`` in ``glu.ACTIVATIONS``."""
    CALLS["glu"] += 1
    return glu.glu_forward(gate, up, activation)


@glu_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@custom_op("adapt::glu_backward", mutates_args=())
def glu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                 activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    CALLS["glu_backward"] += 1
    return glu.glu_backward(dy, gate, up, activation)


@glu_backward.register_fake
def _(dy, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _glu_setup(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _glu_grad(ctx, dy):
    gate, up = ctx.saved_tensors
    dgate, dup = torch.ops.adapt.glu_backward(dy, gate, up, ctx.activation)
    return dgate, dup, None


register_autograd("adapt::glu", _glu_grad, setup_context=_glu_setup)


# ---------------------------------------------------------------- rotary embedding


@custom_op("adapt::apply_rotary", mutates_args=())
def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                 rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated in one launch; outputs keep the inputs' memory layouts."""
    CALLS["apply_rotary"] += 1
    return rope.rotate(q, k, cos, sin, interleaved, rotary_dim, inverse=False)


@apply_rotary.register_fake
def _(q, k, cos, sin, interleaved, rotary_dim):
    return torch.empty_like(q), torch.empty_like(k)


@custom_op("adapt::apply_rotary_backward", mutates_args=())
def apply_rotary_backward(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                          rotary_dim: int, q_stride: list[int],
                          k_stride: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse rotation, written with the strides of q and k (no relayout of the gradients)."""
    CALLS["apply_rotary_backward"] += 1
    return rope.rotate(dq, dk, cos, sin, interleaved, rotary_dim, inverse=True, q_out_stride=q_stride,
                       k_out_stride=k_stride)


@apply_rotary_backward.register_fake
def _(dq, dk, cos, sin, interleaved, rotary_dim, q_stride, k_stride):
    return dq.new_empty_strided(dq.shape, q_stride), dk.new_empty_strided(dk.shape, k_stride)


def _rotary_setup(ctx, inputs, output):
    _, _, cos, sin, interleaved, rotary_dim = inputs
    ctx.save_for_backward(cos, sin)
    ctx.meta = (interleaved, rotary_dim, list(output[0].stride()), list(output[1].stride()))


def _rotary_grad(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    interleaved, rotary_dim, q_stride, k_stride = ctx.meta
    dq_in, dk_in = torch.ops.adapt.apply_rotary_backward(dq, dk, cos, sin, interleaved, rotary_dim, q_stride, k_stride)
    return dq_in, dk_in, None, None, None, None


register_autograd("adapt::apply_rotary", _rotary_grad, setup_context=_rotary_setup)


# ---------------------------------------------------------------- fused linear cross-entropy


def _ce_opts(ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size):
    return {"ignore_index": ignore_index, "label_smoothing": label_smoothing, "z_loss": z_loss, "softcap": softcap,
                "reduction": reduction, "chunk_size": chunk_size}


@custom_op("adapt::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               bias: torch.Tensor | None, ignore_index: int, label_smoothing: float, z_loss: float,
                               softcap: float | None, reduction: str, chunk_size: int | None, need_dh: bool,
                               need_dw: bool,
                               need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 loss, d hidden, d weight, fp32 d bias) for ``hidden`` ``[T, H]``.

    With ``reduction`` "mean" or "sum" the gradients asked for are computed here, chunk by chunk, while
    each chunk's logits exist (the backward only scales them); "none" leaves them empty for the backward.
    """
    CALLS["fused_linear_cross_entropy"] += 1
    opts = _ce_opts(ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size)
    need_db = need_db and bias is not None
    grad_now = reduction != "none" and (need_dh or need_dw or need_db)
    n_valid = (labels != ignore_index).sum().clamp_min(1).to(torch.float32)
    scale = (1.0 / n_valid if reduction == "mean" else torch.ones_like(n_valid)).reshape(1)
    losses, dh, dw, db = cross_entropy.run_chunks(
        hidden, weight, bias, labels, scale, dict(opts, per_row_scale=False), need_grad=grad_now,
        need_dh=grad_now and need_dh, need_dw=grad_now and need_dw, need_db=grad_now and need_db,
    )
    loss = losses if reduction == "none" else (losses.sum() / n_valid if reduction == "mean" else losses.sum())
    return (loss, dh if dh is not None else _nothing(hidden), dw if dw is not None else _nothing(weight),
            db if db is not None else _nothing(losses))


@fused_linear_cross_entropy.register_fake
def _(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size, need_dh,
      need_dw, need_db):
    grad_now = reduction != "none"
    need_db = need_db and bias is not None
    loss = hidden.new_empty(hidden.shape[0] if reduction == "none" else (), dtype=torch.float32)
    return (loss, hidden.new_empty(hidden.shape if grad_now and need_dh else (0,)),
            weight.new_empty(weight.shape if grad_now and need_dw else (0,)),
            hidden.new_empty(weight.shape[0] if grad_now and need_db else 0, dtype=torch.float32))


@custom_op("adapt::fused_linear_cross_entropy_backward", mutates_args=())
def fused_linear_cross_entropy_backward(
    grad_losses: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
    bias: torch.Tensor | None, ignore_index: int, label_smoothing: float, z_loss: float, softcap: float | None,
    chunk_size: int | None, need_dh: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token losses' backward (``reduction="none"``): the chunks are recomputed, each row scaled by its gradient."""
    CALLS["fused_linear_cross_entropy_backward"] += 1
    opts = _ce_opts(ignore_index, label_smoothing, z_loss, softcap, "none", chunk_size)
    need_db = need_db and bias is not None
    _, dh, dw, db = cross_entropy.run_chunks(
        hidden, weight, bias, labels, grad_losses.float().contiguous(), dict(opts, per_row_scale=True),
        need_grad=True, need_dh=need_dh, need_dw=need_dw, need_db=need_db,
    )
    return (dh if dh is not None else _nothing(hidden), dw if dw is not None else _nothing(weight),
            db if db is not None else _nothing(grad_losses).float())


@fused_linear_cross_entropy_backward.register_fake
def _(grad_losses, hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, chunk_size, need_dh,
      need_dw, need_db):
    need_db = need_db and bias is not None
    return (hidden.new_empty(hidden.shape if need_dh else (0,)), weight.new_empty(weight.shape if need_dw else (0,)),
            hidden.new_empty(weight.shape[0] if need_db else 0, dtype=torch.float32))


def _ce_setup(ctx, inputs, output):
    hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size, *_ = inputs
    ctx.reduction = reduction
    ctx.opts = (ignore_index, label_smoothing, z_loss, softcap, chunk_size)
    ctx.bias_dtype = bias.dtype if bias is not None else None
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, labels, bias)
    else:
        ctx.save_for_backward(*output[1:])
    ctx.mark_non_differentiable(*output[1:])


def _ce_grad(ctx, grad_loss, *_):
    if ctx.reduction == "none":
        hidden, weight, labels, bias = ctx.saved_tensors
        need = ctx.needs_input_grad
        dh, dw, db = torch.ops.adapt.fused_linear_cross_entropy_backward(grad_loss, hidden, weight, labels, bias,
                                                                         *ctx.opts, need[0], need[1], need[3])
    else:  # the forward computed the gradients of the reduced loss; scale them by what flows in
        dh, dw, db = (g * grad_loss.to(g.dtype) if g.numel() else g for g in ctx.saved_tensors)
    db = _none_if_empty(db)
    return (_none_if_empty(dh), _none_if_empty(dw), None, db.to(ctx.bias_dtype) if db is not None else None,
            None, None, None, None, None, None, None, None, None)


register_autograd("adapt::fused_linear_cross_entropy", _ce_grad, setup_context=_ce_setup)


# ---------------------------------------------------------------- MoE routing, permutation, grouped GEMM


@custom_op("adapt::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, top_k: int, scoring: str, n_group: int, topk_group: int, normalize: bool,
              correction_bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights ``[T, k]``, int64 expert ids ``[T, k]``) from row-major router logits ``[T, E]``."""
    CALLS["moe_route"] += 1
    return moe.route_forward(logits, top_k, scoring, n_group, topk_group, normalize, correction_bias, scale)


@moe_route.register_fake
def _(logits, top_k, scoring, n_group, topk_group, normalize, correction_bias, scale):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


@custom_op("adapt::moe_route_backward", mutates_args=())
def moe_route_backward(dweights: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, top_k: int, scoring: str,
                       normalize: bool, scale: float) -> torch.Tensor:
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
    return (expert_ids.new_empty(expert_ids.numel()), expert_ids.new_empty(expert_ids.shape),
            expert_ids.new_empty(num_experts + 1))


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
def moe_unpermute_backward(dy: torch.Tensor, y_sorted: torch.Tensor, weights: torch.Tensor,
                           sorted_position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    """``x[rows of e] @ w[e]`` for every expert ``e``; ``config`` is ``grouped_gemm.encode_config``'s list."""
    CALLS["grouped_gemm"] += 1
    return grouped_gemm.grouped_mm(x, w, group_offsets, False, grouped_gemm.decode_config(config))


@grouped_gemm_op.register_fake
def _(x, w, group_offsets, config):
    return x.new_empty((x.shape[0], w.shape[2]))


@custom_op("adapt::grouped_gemm_backward", mutates_args=())
def grouped_gemm_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor,
                          need_dx: bool, need_dw: bool, config: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx or empty, dw in ``w``'s layout or empty)."""
    CALLS["grouped_gemm_backward"] += 1
    gemm = grouped_gemm.decode_config(config)
    dy = dy.contiguous()
    dx = grouped_gemm.grouped_mm(dy, w, group_offsets, True, gemm) if need_dx else _nothing(x)
    dw = grouped_gemm.grouped_weight_grad(x, dy, w, group_offsets, gemm) if need_dw else _nothing(w)
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
    dx, dw = torch.ops.adapt.grouped_gemm_backward(dy, x, w, group_offsets, ctx.needs_input_grad[0],
                                                   ctx.needs_input_grad[1], ctx.config)
    return _none_if_empty(dx), _none_if_empty(dw), None, None


register_autograd("adapt::grouped_gemm", _gemm_grad, setup_context=_gemm_setup)
