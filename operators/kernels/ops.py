"""adapt's kernels as ``torch.library`` operators in the ``adapt`` namespace.

Each operator has a real implementation (the Triton launch code beside the kernels), a fake one that
only allocates outputs of the right shape, dtype and layout, and, for the forward operators, autograd
whose backward is itself an ``adapt`` operator.  Dynamo and ``torch.export`` therefore see every kernel
as one node, forward and backward, instead of tracing into Triton launch code.

``_registration.kernel_op`` registers the operators here and in ``norm_ops`` as ``custom_op`` (opaque to
Inductor, the default) or, with ``ADAPT_KERNEL_OPS=inductor``, as ``triton_op``, whose launch code AOTAutograd
traces so that Inductor compiles and launches the kernels itself; the MoE and optimizer operators stay
``custom_op``.  Under Triton's CPU interpreter they are always ``custom_op`` (``wrap_triton`` refuses
interpreted kernels).

Statistics a backward needs (row ``rstd``, precomputed loss gradients) are extra outputs, because
autograd's ``setup_context`` can only save inputs and outputs.  Where a gradient is not asked for, its
output is an empty tensor.  The norms' operators live in ``norm_ops``, imported here so that importing this
module registers them too, and the MoE operators in ``moe_ops``.  ``CALLS`` counts real executions per
operator: it advances when a kernel really runs, eager or compiled, never while a graph is traced (in
``inductor`` mode a compiled graph launches the kernels without the operator, so only eager runs count).
"""

from __future__ import annotations

import torch
from torch.library import register_autograd

from . import cross_entropy, glu, norm_ops, rope  # noqa: F401  (norm_ops registers the norms' operators)
from ._op_utils import CALLS, no_gradient, none_if_empty  # noqa: F401  (CALLS: read as ops.CALLS)
from ._registration import kernel_op

# ---------------------------------------------------------------- gated linear units


@kernel_op("adapt::glu", kernels=(glu._glu_fwd,))
def glu_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` with ``activation`` in ``glu.ACTIVATIONS``."""
    return glu.glu_forward(gate, up, activation)


@glu_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@kernel_op("adapt::glu_backward", kernels=(glu._glu_bwd,))
def glu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dgate, dup, _ = glu.glu_backward(dy, gate, up, activation)
    return dgate, dup


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


@kernel_op("adapt::glu_linear", kernels=(glu._glu_fwd,))
def glu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> torch.Tensor:
    """``F.linear(act(gate) * up, weight, bias)``: a gated unit and the projection after it, keeping only
    gate and up for the backward.  The unit's output (as large as gate) is made again by the backward's
    unit kernel, from the loads it makes anyway, for the projection's weight gradient."""
    return torch.nn.functional.linear(glu.glu_forward(gate, up, activation), weight, bias)


@glu_linear.register_fake
def _(gate, up, weight, bias, activation):
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))


@kernel_op("adapt::glu_linear_backward", kernels=(glu._glu_bwd,))
def glu_linear_backward(
    dy: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    activation: str,
    need_dweight: bool,
    need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d gate, d up, d weight, d bias); a gradient not asked for is an empty tensor."""
    dy_rows = dy.reshape(-1, weight.shape[0])
    d_unit = (dy_rows @ weight).view(*gate.shape[:-1], weight.shape[1])
    dgate, dup, unit = glu.glu_backward(d_unit, gate, up, activation, recompute=need_dweight)
    dweight = dy_rows.t() @ unit.reshape(-1, weight.shape[1]) if need_dweight else no_gradient(weight)
    dbias = dy_rows.sum(0) if need_dbias else no_gradient(weight)
    return dgate, dup, dweight, dbias


@glu_linear_backward.register_fake
def _(dy, gate, up, weight, activation, need_dweight, need_dbias):
    return (
        gate.new_empty(gate.shape),
        gate.new_empty(gate.shape),
        weight.new_empty(weight.shape if need_dweight else (0,)),
        weight.new_empty(weight.shape[0] if need_dbias else 0),
    )


def _glu_linear_setup(ctx, inputs, output):
    gate, up, weight, bias, activation = inputs
    ctx.save_for_backward(gate, up, weight)
    ctx.activation = activation


def _glu_linear_grad(ctx, dy):
    gate, up, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    dgate, dup, dweight, dbias = torch.ops.adapt.glu_linear_backward(
        dy, gate, up, weight, ctx.activation, need[2], need[3]
    )
    return dgate, dup, none_if_empty(dweight), none_if_empty(dbias), None


register_autograd("adapt::glu_linear", _glu_linear_grad, setup_context=_glu_linear_setup)


# ---------------------------------------------------------------- rotary embedding


@kernel_op("adapt::apply_rotary", kernels=(rope._rope_kernel,))
def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated in one launch; outputs keep the inputs' memory layouts."""
    return rope.rotate(q, k, cos, sin, interleaved, rotary_dim, inverse=False)


@apply_rotary.register_fake
def _(q, k, cos, sin, interleaved, rotary_dim):
    return torch.empty_like(q), torch.empty_like(k)


@kernel_op("adapt::apply_rotary_backward", kernels=(rope._rope_kernel,))
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


@kernel_op("adapt::fused_linear_cross_entropy", kernels=(cross_entropy._ce_chunk_kernel,))
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


@kernel_op("adapt::fused_linear_cross_entropy_backward", kernels=(cross_entropy._ce_chunk_kernel,))
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
    # the gradient outputs take no gradient: without this autograd allocates zeros of d weight's size for them,
    # at the step's peak (measured: 0.52 GiB for Llama-3.2-1B, benchmarks/results/e2e-h200-memory.md)
    ctx.set_materialize_grads(False)


def _ce_grad(ctx, grad_loss, *_):
    if ctx.reduction == "none":
        hidden, weight, labels, bias = ctx.saved_tensors
        need = ctx.needs_input_grad
        dh, dw, db = torch.ops.adapt.fused_linear_cross_entropy_backward(
            grad_loss, hidden, weight, labels, bias, *ctx.opts, need[0], need[1], need[3]
        )
    else:  # the forward computed the gradients of the reduced loss; scale them by what flows in
        dh, dw, db = _scaled(ctx.saved_tensors, grad_loss)
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


def _scaled(grads: tuple[torch.Tensor, ...], by: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``grads`` times ``by``, in place on plain tensors: a copy would hold a second d weight at the step's
    peak.  One multi-tensor kernel reads ``by`` from device memory: an elementwise ``mul_`` by a 0-dim device
    tensor broadcasts it with stride 0 and loses vectorised access (0.73 ms for Llama-3.2-1B's d weight on the
    H200, e2e-h200.md).  A second backward through the same graph (retain_graph) is then refused by autograd's
    version check on the saved tensors, never scaled twice.  A traced graph (AOTAutograd, export: subclass
    tensors) gets the functional form, whose buffers Inductor plans itself."""
    if any(type(g) is not torch.Tensor for g in grads):
        return [g * by.to(g.dtype) if g.numel() else g for g in grads]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, group in by_dtype.items():
        torch._foreach_mul_(group, by.to(dtype))
    return list(grads)
