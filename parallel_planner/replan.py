"""The plan again once this machine has been measured: ``adapt run`` re-plans after its throughput stage.

The throughput stage measures the adapted model's training step on one device of this machine and writes
it in the calibration format (``parallel_planner.calibration``).  That measurement calibrates the plan
only when it was taken on the GPU type the plan targets and in a 16-bit type: a CPU or another GPU says
nothing about the target's step.  Otherwise the re-plan keeps the plan and says why.  Both plans are kept
with what changed, and each measured run is predicted before and after calibration beside its measured
rate and peak memory: after calibration the prediction meets the measurement, which is what it is for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adapt.core.spec import ModelSpec
from adapt.core.stage_verdicts import Check, StageSummary, SummaryContext, fmt, replan_checks
from parallel_planner.calibration import (
    Calibration,
    calibration_from_dict,
    compute_scale,
    measured_on,
    run_memory_gib,
    run_step_seconds,
)
from parallel_planner.catalog import GpuType
from parallel_planner.cluster import Cluster
from parallel_planner.efficiency import Efficiency
from parallel_planner.profile import profile_model, with_prediction_modules
from parallel_planner.result import PlannerResult, RankedPlan
from parallel_planner.search import plan_parallel
from parallel_planner.workload import Workload

FIGURES = ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "memory_gib_per_gpu")
LAYOUT = ("tp", "pp", "dp", "cp", "ep", "zero", "recompute", "micro_batch", "grad_accum", "vpp", "pp_schedule",
          "offload_optimizer")  # fmt: skip
CALIBRATING_DTYPES = ("bf16", "fp16")  # a 16-bit measurement calibrates a bf16 or fp8 plan's time model


@dataclass
class CalibratedPlan:
    """The plan before and after the throughput stage's measurements, and what changed."""

    applied: bool
    reason: str  # what the measurements replaced, or why they were not applied
    device: str  # where the measurement was taken ("" when nothing was measured)
    target: str  # the GPU type the plan targets
    before: dict[str, Any]  # the best plan's layout and FIGURES before calibration
    after: dict[str, Any] | None = None  # ... after (None: not applied)
    changes: list[str] = field(default_factory=list)  # layout knobs and figures that moved
    measured_runs: list[dict[str, Any]] = field(default_factory=list)  # measured vs predicted before/after
    calibration: dict[str, Any] | None = None  # the measurements as the throughput stage wrote them
    result: PlannerResult | None = None  # the calibrated search in full

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "result"}
        data["result"] = self.result.to_dict() if self.result is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibratedPlan:
        names = {f.name for f in dataclasses.fields(cls)} - {"result"}
        result = PlannerResult.from_dict(data["result"]) if data.get("result") else None
        return cls(result=result, **{k: v for k, v in data.items() if k in names})

    def summary(self, context: SummaryContext | None = None) -> StageSummary:
        """The plan before and after this machine's measurements; a measurement that does not apply passes, saying
        why."""
        data: dict[str, Any] = {
            k: getattr(self, k) for k in ("applied", "reason", "device", "target", "before", "after")
        }
        data["changes"], data["measured_runs"] = list(self.changes), list(self.measured_runs)
        checks = replan_checks(data, (context or SummaryContext()).section("replan"))
        if not self.applied or not self.after:
            return StageSummary(f"plan unchanged: {self.reason}", data, checks)
        before, after = self.before or {}, self.after
        line = (
            f"{self.reason}; step {fmt(before.get('step_time_s'), '.3g')} s -> "
            f"{fmt(after.get('step_time_s'), '.3g')} s, {fmt(before.get('tokens_per_s'), ',.0f')} -> "
            f"{fmt(after.get('tokens_per_s'), ',.0f')} tok/s; {data['changes'][0] if data['changes'] else ''}"
        )
        return StageSummary(line, data, checks)

    def verdict(self, thresholds: dict[str, Any] | None = None) -> list[Check]:
        return replan_checks(self.summary().data, thresholds)


def planning_inputs(result: PlannerResult) -> tuple[Cluster, Workload]:
    """The cluster (measured figures of a local one included) and workload a stored planner answer was made for.
    Fields this version does not know are left out: a stored answer may come from another version."""
    c = result.cluster
    cluster = Cluster(_known(GpuType, c["gpu"]), int(c["num_gpus"]), int(c["gpus_per_node"]))
    return cluster, _known(Workload, result.workload)


def _known(cls, data: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def replan(
    spec: ModelSpec,
    planned: PlannerResult,
    measurements: dict[str, Any] | None,
    top_k: int = 5,
    efficiency: Efficiency | None = None,
) -> CalibratedPlan:
    """Plan ``planned``'s cluster and workload again with ``measurements`` (the calibration JSON; None: nothing
    was measured in this run).  The plan before calibration is recomputed with the same software
    (``efficiency``, default as the plan stage's), so the two differ by the measurements alone."""
    cluster, workload = planning_inputs(planned)
    eff = efficiency or Efficiency()
    before = plan_parallel(spec, cluster, workload, fixed=planned.fixed, top_k=top_k, efficiency=eff)
    base = dict(target=cluster.gpu.name, before=figures(before.best), calibration=measurements)
    if not measurements:
        return CalibratedPlan(False, "nothing measured: the throughput stage is not part of this run", "", **base)
    cal = calibration_from_dict(measurements, "throughput stage")
    why_not = _not_applicable(cal, cluster)
    if why_not:
        return CalibratedPlan(False, why_not, cal.device, **base)
    after = plan_parallel(spec, cluster, workload, fixed=planned.fixed, top_k=top_k, calibration=cal, efficiency=eff)
    runs, scale = _measured_runs(spec, cal, cluster, workload, eff)
    new = figures(after.best)
    return CalibratedPlan(
        True,
        _what_was_replaced(cal, cluster, scale),
        cal.device,
        after=new,
        changes=_changes(base["before"], new),
        measured_runs=runs,
        result=after,
        **base,
    )


def figures(ranked: RankedPlan) -> dict[str, Any]:
    """A ranked plan's layout and predicted figures, flat (``RankedPlan.to_dict`` keys)."""
    data = ranked.to_dict()
    return {k: data[k] for k in (*LAYOUT, *FIGURES, "fits")}


def _not_applicable(cal: Calibration, cluster: Cluster) -> str:
    if not measured_on(cal.device, cluster.gpu):
        return f"measured on {cal.device}, which is not the {cluster.gpu.name.upper()} the plan targets"
    if cal.dtype not in CALIBRATING_DTYPES:
        return f"measured in {cal.dtype}; only a 16-bit measurement calibrates the plan's time model"
    return ""


def _measured_runs(
    spec: ModelSpec, cal: Calibration, cluster: Cluster, workload: Workload, eff: Efficiency
) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Each measured run beside the model's prediction of it before and after calibration."""
    from parallel_planner.memory import MemoryModel

    profile = with_prediction_modules(profile_model(spec), workload.mtp_depth)
    calibrated = cal.apply(eff, cluster)
    scale = compute_scale(cal, profile, cluster, workload, calibrated)
    memory = MemoryModel.of(eff)
    rows = []
    for run in cal.runs:
        tokens = run["global_batch"] * run["seq_len"]
        rows.append(
            {
                "gpus": run["gpus"],
                "layout": run.get("layout") or {},
                "seq_len": run["seq_len"],
                "global_batch": run["global_batch"],
                "measured_tokens_per_s": run["tokens_per_s"],
                "before_tokens_per_s": tokens / run_step_seconds(run, profile, cluster, workload, eff),
                "after_tokens_per_s": tokens / run_step_seconds(run, profile, cluster, workload, calibrated, scale),
                "measured_peak_memory_gib": run.get("peak_memory_gib"),
                "predicted_memory_gib": run_memory_gib(run, profile, cluster, workload, memory),
            }
        )
    return rows, scale


def _what_was_replaced(cal: Calibration, cluster: Cluster, scale: np.ndarray) -> str:
    parts = []
    if cal.gemm_efficiency:
        parts.append(f"GEMM rate {cal.gemm_efficiency:.0%} of peak (assumed {cluster.gpu.gemm_ceiling:.0%})")
    if cal.dispatch:
        parts.append("host cost per operator")
    if cal.blocks or cal.runs:
        low, high = float(scale.min()), float(scale.max())
        factor = f"x{low:.2f}" if np.isclose(low, high) else f"x{low:.2f}..x{high:.2f}"
        what = " and ".join(w for w, n in (("blocks", len(cal.blocks)), ("steps", len(cal.runs))) if n)
        parts.append(f"compute {factor} to meet the measured {what}")
    return f"calibrated on {cal.device}: " + "; ".join(parts)


def _changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Layout knobs that moved, then each figure's relative change."""
    moved = [f"{k} {before[k]} -> {after[k]}" for k in LAYOUT if before[k] != after[k]]
    out = [("layout: " + ", ".join(moved)) if moved else "layout unchanged"]
    for key in FIGURES:
        old, new = before[key], after[key]
        if old and not np.isclose(old, new, rtol=1e-6):
            out.append(f"{key} {old:.4g} -> {new:.4g} ({new / old - 1:+.1%})")
    return out


def replan_with_measurements(
    spec: ModelSpec,
    cluster: Cluster,
    workload: Workload,
    measurements: dict[str, Any],
    fixed: dict | str | None = None,
    top_k: int = 5,
    efficiency: Efficiency | None = None,
) -> PlannerResult:
    """``plan_parallel`` with measurements in the calibration JSON format (``calibration_from_measurements``)."""
    calibration = calibration_from_dict(measurements, "measurements")
    return plan_parallel(
        spec, cluster, workload, fixed=fixed, top_k=top_k, efficiency=efficiency, calibration=calibration
    )
