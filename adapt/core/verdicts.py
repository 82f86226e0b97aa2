"""The pass rule of a compared tensor, shared by the alignment stage and ``adapt gate``: per-dtype thresholds and the
verdict, in plain Python so the reports layer judges a finished report without importing torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


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


def verdict(
    cosine: float, rel_err: float, baseline_rel_err: float, limits: Thresholds, negligible: bool = False
) -> bool:
    """The one pass rule, shared by the alignment stage and ``adapt gate``.

    A tensor the unadapted model gets just as wrong in this dtype (an MoE routing flip on a near-tie,
    say) is a cost of the dtype, not of the adaptation: the ratio still applies to it.
    """
    if not (math.isfinite(rel_err) and (negligible or math.isfinite(cosine))):
        return False
    within_limits = (negligible or cosine >= limits.min_cosine) and rel_err <= limits.max_rel_err
    no_worse_than_dtype = limits.allow_dtype_cost and rel_err <= baseline_rel_err
    return (
        within_limits or no_worse_than_dtype
    ) and rel_err <= limits.max_err_ratio * baseline_rel_err + limits.rel_err_floor
