"""The pass rule of a compared tensor, shared by the alignment stage and ``adapt gate``: per-dtype thresholds, the
verdict and the gradients' widened limits, in plain Python so the reports layer judges a finished report without
importing torch.  The decode targets are here for the same reason."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
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


def gradient_thresholds(limits: Thresholds) -> Thresholds:
    """The limits a gradient is judged by: gradients compound every forward error, so the absolute limit is relaxed
    4x and the ratio to the unadapted model's gradient error 2x (a ratio of two compounded errors spreads wider than a
    forward tensor's: bf16 router-weight gradients of a correct MoE plan measured 2.2-3.3 on some fresh draws)."""
    return dataclasses.replace(
        limits,
        max_rel_err=min(1.0, 4 * limits.max_rel_err),
        min_cosine=1 - 4 * (1 - limits.min_cosine),
        max_err_ratio=2 * limits.max_err_ratio,
    )


# A gradient that vanishes in exact arithmetic (a router row no token's loss reaches, a bias a softmax cancels) holds
# only the rounding of the terms that flow through it, and those scale with the model's whole gradient, not with its
# own size: every check that compares gradients measures each one against at least this share of the global gradient
# norm.  In float32 a relative limit of 1e-4 on top of it is about one unit of roundoff (2^-23) of the global norm.
VANISHING_GRADIENT_SHARE = 1e-3


def gradient_floor(norms: Iterable[float]) -> float:
    """The size under which a gradient is measured against ``VANISHING_GRADIENT_SHARE`` of the global gradient norm
    (the L2 norm over every parameter's gradient, given as each gradient's L2 norm) instead of its own norm."""
    return VANISHING_GRADIENT_SHARE * math.hypot(*norms)


# The decode targets: adapted decode tokens/s over each HF generate path, at every batch measured.
DECODE_TARGETS: dict[str, float] = {"hf-static-compile": 1.0, "hf-eager": 3.0}  # the inference benchmark's
# What the throughput stage (and ``adapt gate`` by default) demands: no slower than either HF path.  A model
# whose eager decode is already bound by the GPU cannot reach 3x eager, and that is no defect of the adaptation.
STAGE_DECODE_MINIMA: dict[str, float] = {"hf-static-compile": 1.0, "hf-eager": 1.0}
DECODE_HOST_BOUND_IDLE = 0.3  # GPU idle share of the adapted decode above which its rate is the host's


def decode_targets(
    rows: list[dict[str, Any]],
    on_gpu: bool,
    minima: dict[str, float] | None = None,
    host_bound_idle: float = DECODE_HOST_BOUND_IDLE,
) -> list[dict[str, Any]]:
    """Per batch, the adapted decode rate against each HF path's, judged against ``minima`` (``DECODE_TARGETS``).

    ``rows`` are decode timings (``variant``, ``batch``, ``decode_tokens_per_s``, optional ``gpu_idle_share``).
    A target is inconclusive where either rate is missing, or on a CPU (the host is timed, not the kernels).  On
    a GPU the verdict stands when the adapted decode left the GPU idle more than ``host_bound_idle`` of the time:
    every path decodes the same model at the same realistic shape, and the host's work per token is part of
    what a decode path must cut; the reason then says the figure is host-bound.  A batch fails when any of its
    targets fails, else is inconclusive when any is.  Plain Python: ``adapt gate`` re-judges with it.
    """
    minima = dict(DECODE_TARGETS if minima is None else minima)
    out = []
    for batch in sorted({int(r["batch"]) for r in rows}):
        at = {r["variant"]: r for r in rows if int(r["batch"]) == batch}
        rate = {name: float(r.get("decode_tokens_per_s") or 0.0) for name, r in at.items()}
        adapted = at.get("adapted") or {}
        idle = adapted.get("gpu_idle_share")
        doubt = None if on_gpu else "measured on a CPU, which times the host, not the kernels"
        host_bound = (
            f"host-bound: the adapted decode left the GPU idle {idle:.0%} of the time"
            if on_gpu and isinstance(idle, (int, float)) and idle > host_bound_idle
            else None
        )
        row: dict[str, Any] = {"batch": batch, "adapted_tokens_per_s": rate.get("adapted")}
        verdicts, reasons = [], []
        for baseline, minimum in minima.items():
            key = baseline.removeprefix("hf-").replace("-", "_")
            ratio = (
                rate["adapted"] / rate[baseline] if rate.get("adapted", 0) > 0 and rate.get(baseline, 0) > 0 else None
            )
            if ratio is None:
                missing = [n for n in ("adapted", baseline) if rate.get(n, 0) <= 0]
                verdict, why = "inconclusive", f"{' and '.join(missing)} not measured"
            elif doubt:
                verdict, why = "inconclusive", f"x{ratio:.2f} of {baseline} (min x{minimum:g}), but {doubt}"
            else:
                verdict = "passed" if ratio >= minimum else "failed"
                why = f"x{ratio:.2f} of {baseline} (min x{minimum:g})"
            row |= {f"{key}_tokens_per_s": rate.get(baseline), f"vs_{key}": ratio, f"min_vs_{key}": minimum,
                    f"{key}_verdict": verdict}  # fmt: skip
            verdicts.append(verdict)
            reasons.append(f"{why}: {verdict}")
        row["verdict"] = (
            "failed" if "failed" in verdicts else "inconclusive" if "inconclusive" in verdicts else "passed"
        )
        row["reason"] = f"decode at batch {batch}: " + "; ".join(reasons) + (f" ({host_bound})" if host_bound else "")
        row["host_bound"] = host_bound is not None
        out.append(row)
    return out
