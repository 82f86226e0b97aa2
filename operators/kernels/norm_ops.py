"""adapt's normalisation kernels as ``torch.library`` operators: RMSNorm, residual add + RMSNorm in one pass,
and LayerNorm, each with its backward operator and autograd.  See ``ops`` for the conventions; ``ops`` imports
this module, so importing ``ops`` registers them too.
"""

from __future__ import annotations

import torch
from torch.library import register_autograd

from . import norms
from ._op_utils import no_gradient, none_if_empty
from ._registration import kernel_op
from ._utils import as_rows

# ---------------------------------------------------------------- RMSNorm and residual-add + RMSNorm


@kernel_op("adapt::rms_norm", kernels=(norms._rms_norm_fwd,))
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast: str, config: list[int], store_rstd: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, fp32 row rstd or empty); ``config`` is ``norms.encode_config``'s list."""
    _, y, rstd = norms.rms_forward(x, None, weight, eps, offset, cast, norms.decode_config(config), store_rstd)
    return y.view(x.shape), rstd if store_rstd else no_gradient(y).float()


@rms_norm.register_fake
def _(x, weight, eps, offset, cast, config, store_rstd):
    rows = x.numel() // x.shape[-1] if store_rstd else 0
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32)


@kernel_op("adapt::add_rms_norm", kernels=(norms._rms_norm_fwd,))
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
    s, y, rstd = norms.rms_forward(x, residual, weight, eps, offset, cast, norms.decode_config(config), store_rstd)
    return s.view(x.shape), y.view(x.shape), rstd if store_rstd else no_gradient(y).float()


@add_rms_norm.register_fake
def _(x, residual, weight, eps, offset, cast, config, store_rstd):
    rows = x.numel() // x.shape[-1] if store_rstd else 0
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32)


@kernel_op("adapt::rms_norm_backward", kernels=(norms._rms_norm_bwd,))
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


@kernel_op("adapt::layer_norm", kernels=(norms._layer_norm_fwd,))
def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, config: list[int], store_stats: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, fp32 row mean, fp32 row rstd); the statistics are empty unless ``store_stats``."""
    _, y, mean, rstd = norms.layer_norm_forward(x, weight, bias, eps, norms.decode_config(config), store_stats)
    if not store_stats:
        mean, rstd = no_gradient(y).float(), no_gradient(y).float()
    return y.view(x.shape), mean, rstd


@layer_norm.register_fake
def _(x, weight, bias, eps, config, store_stats):
    rows = x.numel() // x.shape[-1] if store_stats else 0
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@kernel_op("adapt::layer_norm_backward", kernels=(norms._layer_norm_bwd,))
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
