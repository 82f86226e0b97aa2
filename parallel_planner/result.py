"""What the planner returns: ranked plans with their memory and time breakdowns, JSON-ready."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from adapt.core.jsonio import to_jsonable
from adapt.core.stage_verdicts import Check, StageSummary, SummaryContext, fmt, num, pct, plan_checks
from parallel_planner.plan import ParallelPlan

KNOB_KEYS = ("sp", "tp_overlap", "grad_overlap", "ep_overlap")  # the evaluated knobs a ranked plan carries
SUMMARY_FIELDS = (
    "tp", "pp", "dp", "cp", "ep", "zero", "recompute", "micro_batch", "grad_accum", "vpp",
    "memory_gib_per_gpu", "step_time_s", "tokens_per_s", "mfu", "hfu",
)  # fmt: skip  # a ranked plan's columns in the report


@dataclass
class RankedPlan:
    rank: int
    plan: ParallelPlan
    fits: bool
    memory_gib_per_gpu: float  # the fullest stage
    memory_breakdown: dict[str, float]  # GiB per component on the fullest stage
    memory_per_stage_gib: list[float]
    usable_memory_gib: float
    step_time_s: float
    time_breakdown: dict[str, float]
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float  # model FLOPs (no recompute) over dense bf16 peak
    hfu: float  # hardware FLOPs (with recompute) over dense bf16 peak
    torchrun: str  # the `adapt train` launch of a training plan ("" for inference plans)
    host_bound: bool = False  # the CPU takes longer to issue a micro-batch than the GPU takes to run it
    knobs: dict[str, Any] = field(default_factory=dict)  # sp, tp_overlap, grad_overlap, ep_overlap as evaluated

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        return {
            "rank": self.rank,
            "tp": p.tp,
            "pp": p.pp,
            "dp": p.dp,
            "dp_replicate": p.dp_replicate,
            "dp_shard": p.dp_shard,
            "cp": p.cp,
            "ep": p.ep,
            "zero": p.zero,
            "recompute": p.recompute,
            "micro_batch": p.micro_batch,
            "grad_accum": p.grad_accum,
            "vpp": p.vpp,
            "pp_schedule": p.pp_schedule,
            "offload_optimizer": p.offload_optimizer,
            "fits": self.fits,
            "memory_gib_per_gpu": self.memory_gib_per_gpu,
            "memory_breakdown": self.memory_breakdown,
            "memory_per_stage_gib": self.memory_per_stage_gib,
            "usable_memory_gib": self.usable_memory_gib,
            "step_time_s": self.step_time_s,
            "time_breakdown": self.time_breakdown,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "torchrun": self.torchrun,
            "host_bound": self.host_bound,
            **self.knobs,
            "plan": p.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankedPlan:
        """Inverse of ``to_dict``: the flattened layout fields are read back from ``plan``."""
        names = {f.name for f in fields(cls)} - {"plan", "knobs"}
        knobs = {k: data[k] for k in KNOB_KEYS if k in data}  # flattened by to_dict
        return cls(
            plan=ParallelPlan.from_dict(data["plan"]), knobs=knobs, **{k: v for k, v in data.items() if k in names}
        )


@dataclass
class PlannerResult:
    plans: list[RankedPlan]
    binding_constraint: str
    searched: int  # candidate layouts scored
    feasible: int  # of which fit memory and every constraint
    fixed: dict[str, Any] | None = None
    cluster: dict[str, Any] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)
    efficiency: dict[str, Any] = field(default_factory=dict)  # the time model's constants and software
    calibration: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> RankedPlan:
        return self.plans[0]

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "plans"}
        data["plans"] = [p.to_dict() for p in self.plans]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlannerResult:
        """A stored result (``to_dict``) as the pipeline hands it to a later stage."""
        names = {f.name for f in fields(cls)} - {"plans"}
        plans = [RankedPlan.from_dict(p) for p in data.get("plans", [])]
        return cls(plans=plans, **{k: v for k, v in data.items() if k in names})

    def summary(self, context: SummaryContext | None = None) -> StageSummary:
        """What the report shows of the plan stage: the ranked layouts, the best one's breakdowns and command."""
        context = context or SummaryContext()
        result = to_jsonable(self.to_dict())
        plans = result.get("plans", [])
        ranked = [{k: p.get(k) for k in SUMMARY_FIELDS} for p in plans]
        best = plans[0] if plans else None
        cluster = cluster_label(result.get("cluster") or {}, context)
        data = {
            "cluster": cluster,
            "workload": {
                "seq_len": context.plan_seq_len,
                "global_batch": context.plan_global_batch,
                "precision": context.precision,
            },
            "plans": ranked,
            "best": {
                **ranked[0],
                "memory_breakdown": best.get("memory_breakdown", {}),
                "time_breakdown": best.get("time_breakdown", {}),
                "command": best.get("torchrun"),
            }
            if best
            else None,
            "fits": bool(best and best.get("fits", True)),
            "binding_constraint": result.get("binding_constraint"),
            "searched": result.get("searched"),
            "feasible": result.get("feasible"),
        }
        checks = plan_checks(data, context.section("plan"))
        if not data["fits"]:
            return StageSummary(f"no layout fits {cluster}: {result.get('binding_constraint')}", data, checks)
        layout = " ".join(f"{k}={best.get(k)}" for k in ("tp", "pp", "dp", "cp", "ep", "zero"))
        line = (
            f"{cluster}: {layout}, {fmt(best.get('memory_gib_per_gpu'), '.1f')} GiB/GPU, "
            f"{fmt(best.get('tokens_per_s'), ',.0f')} tok/s, MFU {pct(num(best.get('mfu')))}"
        )
        return StageSummary(line, data, checks)

    def verdict(self, thresholds: dict[str, Any] | None = None) -> list[Check]:
        return plan_checks(self.summary().data, thresholds)


def cluster_label(cluster: dict[str, Any], context: SummaryContext) -> str:
    """The cluster as asked for; a local one also names the GPUs it measured (``local (1xH200)``)."""
    if not context.local_cluster or not cluster:
        return str(context.cluster)
    return f"{context.cluster} ({cluster.get('num_gpus')}x{str(cluster['gpu'].get('name', '?')).upper()})"
