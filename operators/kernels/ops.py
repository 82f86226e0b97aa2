"""adapt's kernels as ``torch.library`` operators in the ``adapt`` namespace.

Each operator has a real implementation (the Triton launch code beside the kernels), a fake one that
only allocates outputs of the right shape, dtype and layout, and, for the forward operators, autograd
whose backward is itself an ``adapt`` operator.  Dynamo, AOTAutograd and ``torch.export`` therefore
see every kernel as one node, forward and backward, instead of tracing into Triton launch code.

The operators are ``custom_op`` (opaque to Inductor): ``triton_op`` cannot run its fake pass on
kernels built for Triton's CPU interpreter, and one registration must serve CUDA and the interpreter.
Statistics a backward needs (row ``rstd``, precomputed loss gradients) are extra outputs, because
autograd's ``setup_context`` can only save inputs and outputs.  Where a gradient is not asked for, its
output is an empty tensor.  The MoE operators live in ``moe_ops``.  ``CALLS`` counts real executions per operator: it advances when a kernel
really runs, eager or compiled, never while a graph is traced.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.library import custom_op, register_autograd

from . import cross_entropy, glu, norms, rope
from ._utils import as_rows

CALLS: Counter[str] = Counter()  # adapt operator name -> real (non-fake) executions


def none_if_empty(t: torch.Tensor) -> torch.Tensor | None:
    """A gradient output back to autograd's None when it is the empty placeholder."""
    return t if t.numel() else None


def no_gradient(like: torch.Tensor) -> torch.Tensor:
    """The empty output standing for something not asked for (a gradient, forward statistics)."""
    return like.new_empty(0)


# ---------------------------------------------------------------- RMSNorm and residual-add + RMSNorm


@custom_op("adapt::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast: str, config: list[int], store_rstd: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, fp32 row rstd or empty); ``config`` is ``norms.encode_config``'s list."""
    CALLS["rms_norm"] += 1
    _, y, rstd = norms.rms_forward(x, None, weight, eps, offset, cast, norms.decode_config(config), store_rstd)
    return y.view(x.shape), rstd if store_rstd else no_gradient(y).float()


@rms_norm.register_fake
def _(x, weight, eps, offset, cast, config, store_rstd):
    rows = x.numel() // x.shape[-1] if store_rstd else 0
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32)


@custom_op("adapt::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    cast: str,
    config: list[int],
    store_rstd: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm, fp32 row rstd or empty) in one pass."""
    CALLS["add_rms_norm"] += 1
    s, y, rstd = norms.rms_forward(x, residual, weight, eps, offset, cast, norms.decode_config(config), store_rstd)
    return s.view(x.shape), y.view(x.shape), rstd if store_rstd else no_gradient(y).float()


@add_rms_norm.register_fake
def _(x, residual, weight, eps, offset, cast, config, store_rstd):
    rows = x.numel() // x.shape[-1] if store_rstd else 0
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32)


@custom_op("adapt::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    dy: torch.Tensor,
    dsum: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    cast: str,
    need_dw: bool,
    config: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight or empty); ``dsum`` is the gradient reaching the residual sum directly (fused add)."""
    CALLS["rms_norm_backward"] += 1
    if rstd.numel() == 0:
        raise RuntimeError("adapt::rms_norm_backward needs the forward's rstd (run the forward with store_rstd)")
    x_rows = as_rows(x).contiguous()
    dx, dw = norms.rms_backward(dy, dsum, x_rows, weight, rstd, offset, cast, need_dw, norms.decode_config(config))
    return dx.view(x.shape), dw if need_dw else no_gradient(weight)


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
    return dx, none_if_empty(dw), None, None, None, None, None


register_autograd("adapt::rms_norm", _rms_backward, setup_context=_rms_setup)


def _add_rms_setup(ctx, inputs, output):
    _, _, weight, _, offset, cast, config, _ = inputs
    ctx.save_for_backward(output[0], weight, output[2])
    ctx.meta = (offset, cast, config)


def _add_rms_backward(ctx, dsum, dy, _drstd):
    total, weight, rstd = ctx.saved_tensors
    offset, cast, config = ctx.meta
    dx, dw = torch.ops.adapt.rms_norm_backward(
        dy, dsum, total, weight, rstd, offset, cast, ctx.needs_input_grad[2], config
    )
    return dx, dx, none_if_empty(dw), None, None, None, None, None


register_autograd("adapt::add_rms_norm", _add_rms_backward, setup_context=_add_rms_setup)


# ---------------------------------------------------------------- LayerNorm


@custom_op("adapt::layer_norm", mutates_args=())
def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, config: list[int], store_stats: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, fp32 row mean, fp32 row rstd); the statistics are empty unless ``store_stats``."""
    CALLS["layer_norm"] += 1
    _, y, mean, rstd = norms.layer_norm_forward(x, weight, bias, eps, norms.decode_config(config), store_stats)
    if not store_stats:
        mean, rstd = no_gradient(y).float(), no_gradient(y).float()
    return y.view(x.shape), mean, rstd


@layer_norm.register_fake
def _(x, weight, bias, eps, config, store_stats):
    rows = x.numel() // x.shape[-1] if store_stats else 0
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@custom_op("adapt::layer_norm_backward", mutates_args=())
def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    need_dw: bool,
    need_db: bool,
    config: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight or empty, dbias or empty)."""
    CALLS["layer_norm_backward"] += 1
    need_db = need_db and bias is not None
    x_rows = as_rows(x).contiguous()
    dx, dw, db = norms.layer_norm_backward(
        dy, x_rows, weight, mean, rstd, need_dw, need_db, norms.decode_config(config)
    )
    return (
        dx.view(x.shape),
        dw.to(weight.dtype) if need_dw else no_gradient(weight),
        db.to(bias.dtype) if need_db else no_gradient(weight),
    )


@layer_norm_backward.register_fake
def _(dy, x, weight, bias, mean, rstd, need_dw, need_db, config):
    need_db = need_db and bias is not None
    return (
        x.new_empty(x.shape),
        weight.new_empty(weight.shape if need_dw else (0,)),
        (bias if need_db else weight).new_empty(bias.shape if need_db else (0,)),
    )


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, _, config, _ = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.config = config


def _layer_norm_grad(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.adapt.layer_norm_backward(
        dy, x, weight, bias, mean, rstd, ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.config
    )
    return dx, none_if_empty(dw), none_if_empty(db), None, None, None


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
def glu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
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
def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated in one launch; outputs keep the inputs' memory layouts."""
    CALLS["apply_rotary"] += 1
    return rope.rotate(q, k, cos, sin, interleaved, rotary_dim, inverse=False)


@apply_rotary.register_fake
def _(q, k, cos, sin, interleaved, rotary_dim):
    return torch.empty_like(q), torch.empty_like(k)


@custom_op("adapt::apply_rotary_backward", mutates_args=())
def apply_rotary_backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    rotary_dim: int,
    q_stride: list[int],
    k_stride: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse rotation, written with the strides of q and k (no relayout of the gradients)."""
    CALLS["apply_rotary_backward"] += 1
    return rope.rotate(
        dq, dk, cos, sin, interleaved, rotary_dim, inverse=True, q_out_stride=q_stride, k_out_stride=k_stride
    )


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
    return {
        "ignore_index": ignore_index,
        "label_smoothing": label_smoothing,
        "z_loss": z_loss,
        "softcap": softcap,
        "reduction": reduction,
        "chunk_size": chunk_size,
    }


@custom_op("adapt::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    reduction: str,
    chunk_size: int | None,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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
        hidden,
        weight,
        bias,
        labels,
        scale,
        dict(opts, per_row_scale=False),
        need_grad=grad_now,
        need_dh=grad_now and need_dh,
        need_dw=grad_now and need_dw,
        need_db=grad_now and need_db,
    )
    loss = losses if reduction == "none" else (losses.sum() / n_valid if reduction == "mean" else losses.sum())
    return (
        loss,
        dh if dh is not None else no_gradient(hidden),
        dw if dw is not None else no_gradient(weight),
        db if db is not None else no_gradient(losses),
    )


@fused_linear_cross_entropy.register_fake
def _(
    hidden,
    weight,
    labels,
    bias,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    reduction,
    chunk_size,
    need_dh,
    need_dw,
    need_db,
):
    grad_now = reduction != "none"
    need_db = need_db and bias is not None
    loss = hidden.new_empty(hidden.shape[0] if reduction == "none" else (), dtype=torch.float32)
    return (
        loss,
        hidden.new_empty(hidden.shape if grad_now and need_dh else (0,)),
        weight.new_empty(weight.shape if grad_now and need_dw else (0,)),
        hidden.new_empty(weight.shape[0] if grad_now and need_db else 0, dtype=torch.float32),
    )


@custom_op("adapt::fused_linear_cross_entropy_backward", mutates_args=())
def fused_linear_cross_entropy_backward(
    grad_losses: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    chunk_size: int | None,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token losses' backward (``reduction="none"``): the chunks are recomputed, each row scaled by its gradient."""
    CALLS["fused_linear_cross_entropy_backward"] += 1
    opts = _ce_opts(ignore_index, label_smoothing, z_loss, softcap, "none", chunk_size)
    need_db = need_db and bias is not None
    _, dh, dw, db = cross_entropy.run_chunks(
        hidden,
        weight,
        bias,
        labels,
        grad_losses.float().contiguous(),
        dict(opts, per_row_scale=True),
        need_grad=True,
        need_dh=need_dh,
        need_dw=need_dw,
        need_db=need_db,
    )
    return (
        dh if dh is not None else no_gradient(hidden),
        dw if dw is not None else no_gradient(weight),
        db if db is not None else no_gradient(grad_losses).float(),
    )


@fused_linear_cross_entropy_backward.register_fake
def _(
    grad_losses,
    hidden,
    weight,
    labels,
    bias,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    chunk_size,
    need_dh,
    need_dw,
    need_db,
):
    need_db = need_db and bias is not None
    return (
        hidden.new_empty(hidden.shape if need_dh else (0,)),
        weight.new_empty(weight.shape if need_dw else (0,)),
        hidden.new_empty(weight.shape[0] if need_db else 0, dtype=torch.float32),
    )


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
        dh, dw, db = torch.ops.adapt.fused_linear_cross_entropy_backward(
            grad_loss, hidden, weight, labels, bias, *ctx.opts, need[0], need[1], need[3]
        )
    else:  # the forward computed the gradients of the reduced loss; scale them by what flows in
        dh, dw, db = (g * grad_loss.to(g.dtype) if g.numel() else g for g in ctx.saved_tensors)
    db = none_if_empty(db)
    return (
        none_if_empty(dh),
        none_if_empty(dw),
        None,
        db.to(ctx.bias_dtype) if db is not None else None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


register_autograd("adapt::fused_linear_cross_entropy", _ce_grad, setup_context=_ce_setup)
