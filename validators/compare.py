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

from adapt.core.verdicts import DEFAULT_THRESHOLDS, Thresholds, verdict

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
