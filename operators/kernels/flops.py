"""FLOP formulas for adapt's operators that run matrix products inside them, registered with torch's FLOP counter.

``torch.utils.flop_counter.FlopCounterMode`` sees an adapt operator as one call and never the GEMMs inside it, so
without these an adapted model's counted FLOPs would lose its down projections, its loss head and its experts.
Each formula counts the operator's own GEMMs (2 FLOPs per multiply-add); elementwise work is not counted, as
torch counts none for its own elementwise operators.  Arguments arrive as shapes (``register_flop_formula``).
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

from . import moe_ops, ops  # noqa: F401  (registers the operators these formulas count)

_adapt = torch.ops.adapt


def _rows(shape) -> int:
    return math.prod(shape[:-1])


@register_flop_formula(_adapt.glu_linear)
def _glu_linear(gate, up, weight, bias, activation, out_shape=None) -> int:
    return 2 * _rows(gate) * weight[0] * weight[1]


@register_flop_formula(_adapt.glu_linear_backward)
def _glu_linear_backward(dy, gate, up, weight, activation, need_dweight, need_dbias, out_shape=None) -> int:
    return 2 * _rows(gate) * weight[0] * weight[1] * (2 if need_dweight else 1)


def _head_gemms(hidden, weight, need: int) -> int:
    return 2 * hidden[0] * hidden[1] * weight[0] * need


@register_flop_formula(_adapt.fused_linear_cross_entropy)
def _fused_linear_cross_entropy(
    hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size,
    need_dh, need_dw, need_db, out_shape=None,
) -> int:  # fmt: skip
    gradients_now = reduction != "none"  # (otherwise the backward operator makes them)
    return _head_gemms(hidden, weight, 1 + gradients_now * (bool(need_dh) + bool(need_dw)))


@register_flop_formula(_adapt.fused_linear_cross_entropy_backward)
def _fused_linear_cross_entropy_backward(
    grad_losses, hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, chunk_size,
    need_dh, need_dw, need_db, out_shape=None,
) -> int:  # fmt: skip
    return _head_gemms(hidden, weight, 1 + bool(need_dh) + bool(need_dw))  # the logits again, then the gradients


@register_flop_formula(_adapt.grouped_gemm)
def _grouped_gemm(x, w, group_offsets, config, out_shape=None) -> int:
    return 2 * x[0] * w[1] * w[2]


@register_flop_formula(_adapt.grouped_gemm_backward)
def _grouped_gemm_backward(dy, x, w, group_offsets, need_dx, need_dw, config, out_shape=None) -> int:
    return 2 * x[0] * w[1] * w[2] * (bool(need_dx) + bool(need_dw))
