"""Tensor comparison against a high-precision reference, and the per-dtype verdict.

Every candidate tensor is judged twice against the float64 (or float32) reference: on its own
(cosine, relative L2, max abs) and relative to the *unadapted model in the same dtype*.  The
ratio ``err(candidate) / err(unadapted)`` separates what adaptation costs from what the dtype
alone costs, the same idea as ``torch._dynamo``'s fp64-anchored accuracy check.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Thresholds:
    """Pass limits for one dtype.  A tensor passes when it is finite,
    ``rel_err <= max_err_ratio * rel_err(unadapted) + rel_err_floor``, and either ``cosine >= min_cosine``
    and ``rel_err <= max_rel_err`` or it is no worse than the unadapted model in the same dtype."""

    min_cosine: float
    max_rel_err: float
    max_err_ratio: float = 2.0
    rel_err_floor: float = 1e-5  # absorbs the case where the unadapted error is ~0 (same kernels)
    allow_dtype_cost: bool = True  # waive the absolute limits where the unadapted model is as wrong

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Defaults: fp32 must be nearly exact; bf16 keeps 8 mantissa bits, so a 16-layer stack drifts to a
# few 1e-2 in relative L2 even when nothing is wrong, and MoE routing flips on near-tied router
# scores push single tensors past 0.1.  The floors are about five units of roundoff of the dtype
# (bf16 2^-9, fp16 2^-11): a kernel that rounds at different points than eager is no worse for it,
# and on a small gradient (a router row, a norm weight) summed over few tokens the unadapted
# model's own error can be luckily small.  Override per run with ``thresholds=``.
DEFAULT_THRESHOLDS: dict[str, Thresholds] = {
    "fp32": Thresholds(min_cosine=0.99999, max_rel_err=1e-3, max_err_ratio=2.0, rel_err_floor=1e-5),
    "fp16": Thresholds(min_cosine=0.995, max_rel_err=0.1, max_err_ratio=2.0, rel_err_floor=2e-3),
    "bf16": Thresholds(min_cosine=0.98, max_rel_err=0.25, max_err_ratio=2.0, rel_err_floor=1e-2),
}

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    from adapt.core.errors import BadInput

    if name not in DTYPES:
        raise BadInput(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def thresholds_for(dtype_name: str, overrides: Thresholds | dict[str, float] | None = None) -> Thresholds:
    if isinstance(overrides, Thresholds):
        return overrides
    base = DEFAULT_THRESHOLDS[dtype_name]
    return dataclasses.replace(base, **(overrides or {}))


@dataclass
class TensorError:
    cosine: float
    rel_err: float
    max_abs: float
    finite: bool
    negligible: bool = False  # reference norm below the floor: cosine is noise and is not judged


def tensor_error(reference: torch.Tensor, candidate: torch.Tensor, norm_floor: float = 0.0) -> TensorError:
    """Error of ``candidate`` against ``reference``, computed in float64 on the CPU.

    ``norm_floor`` guards tensors that are zero in exact arithmetic (e.g. the gradient of an
    attention key bias): their relative error is taken against the floor instead of noise.
    """
    ref = reference.detach().to("cpu", torch.float64).flatten()
    cand = candidate.detach().to("cpu", torch.float64).flatten()
    if ref.shape != cand.shape:
        raise ValueError(f"shape mismatch: reference {tuple(reference.shape)} vs candidate {tuple(candidate.shape)}")
    finite = bool(torch.isfinite(cand).all())
    if not finite:
        return TensorError(cosine=float("nan"), rel_err=float("inf"), max_abs=float("inf"), finite=False)
    diff = cand - ref
    ref_norm = ref.norm().item()
    cand_norm = cand.norm().item()
    if ref_norm == 0.0 and cand_norm == 0.0:
        cosine = 1.0
    elif ref_norm == 0.0 or cand_norm == 0.0:
        cosine = 0.0
    else:
        cosine = float(torch.dot(ref, cand).item() / (ref_norm * cand_norm))
    denom = max(ref_norm, norm_floor)
    rel_err = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    negligible = ref_norm < norm_floor
    return TensorError(cosine=cosine, rel_err=rel_err, max_abs=max_abs, finite=True, negligible=negligible)


@dataclass
class LayerResult:
    """One compared tensor: a block output, a component output inside a block, or the logits."""

    name: str  # module path (or "logits", or a parameter name for gradients)
    block: int | None  # index in the block list, None outside the blocks
    component: str | None  # path inside the block ("self_attn", "mlp.experts"), None for a whole block
    cosine: float
    rel_err: float
    max_abs: float
    err_ratio: float  # rel_err(candidate) / rel_err(unadapted, same dtype)
    baseline_rel_err: float
    passed: bool
    negligible: bool = False  # reference norm under the floor: cosine not judged
    excluded_tokens: int = 0  # tokens left out: MoE expert choice undecidable in the dtype (validators.routing)

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_float(v) for k, v in dataclasses.asdict(self).items()}


def _json_float(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def judge(
    name: str,
    block: int | None,
    component: str | None,
    reference: torch.Tensor,
    candidate: torch.Tensor,
    baseline: torch.Tensor,
    limits: Thresholds,
    norm_floor: float = 0.0,
) -> LayerResult:
    cand = tensor_error(reference, candidate, norm_floor)
    base = tensor_error(reference, baseline, norm_floor)
    ratio = cand.rel_err / max(base.rel_err, 1e-12) if cand.finite else float("inf")
    passed = cand.finite and verdict(cand.cosine, cand.rel_err, base.rel_err, limits, cand.negligible)
    return LayerResult(
        name=name,
        block=block,
        component=component,
        cosine=cand.cosine,
        rel_err=cand.rel_err,
        max_abs=cand.max_abs,
        err_ratio=ratio,
        baseline_rel_err=base.rel_err,
        passed=bool(passed),
        negligible=cand.negligible,
    )


def verdict(cosine: float, rel_err: float, baseline_rel_err: float, limits: Thresholds, negligible: bool = False) -> bool:
    """The one pass rule, shared by the alignment stage and ``adapt gate``.

    A tensor the unadapted model gets just as wrong in this dtype (an MoE routing flip on a near-tie,
    say) is a cost of the dtype, not of the adaptation: the ratio still applies to it.
    """
    if not (math.isfinite(rel_err) and (negligible or math.isfinite(cosine))):
        return False
    within_limits = (negligible or cosine >= limits.min_cosine) and rel_err <= limits.max_rel_err
    no_worse_than_dtype = limits.allow_dtype_cost and rel_err <= baseline_rel_err
    return (within_limits or no_worse_than_dtype) and rel_err <= limits.max_err_ratio * baseline_rel_err + limits.rel_err_floor
