"""The operators stage's typed result and its JSON form, both ways.

``OpsReport.to_dict()`` is ``ops.json`` and the pipeline's stored stage result; ``OpsReport.from_dict``
rebuilds the typed report from it, so a stage that reads a stored operators result (alignment, bench,
soak) gets the same kernel plan without loading, tracing, probing or timing the model again.  What
the round trip keeps: the profile with its rules, the target, the whole plan, the recognised components
and rejections, ONNX, generated kernels, the patch check, the phase seconds and the comparison with intake's
spec (``operators.agreement``).  The inventory comes back as its summary (tracer, device, input shape, seconds,
traced blocks): its per-module records and captured inputs stay with the process that traced them; the
per-overload decisions are in the plan.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from adapt.core.jsonio import to_jsonable
from adapt.core.stage_verdicts import (
    Check,
    StageSummary,
    SummaryContext,
    num,
    operator_checks,
    pct,
    plural,
    unsupported_count,
)
from operators.agreement import Agreement
from operators.generated import GeneratedKernel
from operators.inventory import OnnxReport, OpInventory, json_ready
from operators.mapping import KernelChoice, KernelPlan, OpDecision
from operators.profiles import BackendProfile, OpRule
from operators.recognition import Recognition
from operators.recognition.component import Component
from operators.recognition.variants import variant_from_dict
from operators.registry import Target


@dataclass
class PatchCheck:
    ran: bool
    passed: bool = False
    logits_max_abs_diff: float | None = None
    grad_max_rel_diff: float | None = None
    state_dict_unchanged: bool = False
    reverted_exactly: bool = False
    attention_kernel_calls: int = 0
    patched_modules: int = 0
    residual_fusion: dict[str, int] = field(default_factory=dict)  # pairs, fused and missed norm calls
    note: str = ""


@dataclass
class OpsReport:
    source: str
    profile: BackendProfile
    target: Target
    inventory: OpInventory
    recognition: Recognition
    plan: KernelPlan
    onnx: OnnxReport | None
    generated: list[GeneratedKernel] = field(default_factory=list)
    patch_check: PatchCheck | None = None
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per part of the stage
    onnx_blocks: dict[str, int] | None = None  # blocks in the exported graph, of how many
    agreement: Agreement | None = None  # intake's spec against the recognition; None: the stage had no spec

    def new(self) -> list[dict[str, Any]]:
        """What this model has that no recognised kind covers, with how it runs."""
        out = []
        for c in self.plan.components:
            if c.kind == "new":
                out.append({"module": c.module, "ops": list(c.variant.ops), "status": c.status, "kernel": c.kernel})
        listed = {item["module"] for item in out}
        claimed = {c.module for c in self.recognition.components if c.confirmed}
        for r in self.recognition.rejected:  # look-alikes: each one's entry says why no kind claimed it
            if r["module"] in claimed:  # rejected as one kind, confirmed as another: not new
                continue
            entry = {"rejected_candidate": r["candidate"], "reason": r["reason"]}
            if r["module"] in listed:
                next(item for item in out if item["module"] == r["module"]).update(entry)
            else:
                out.append({"module": r["module"], **entry, "status": "native"})
        return out

    def to_dict(self) -> dict[str, Any]:
        inv = self.inventory
        return json_ready(
            {
                "source": self.source,
                "profile": self.profile,  # with its rules: the rebuilt report judges ops as this one did
                "target": self.target.to_dict(),
                "tracer": inv.tracer,
                "traced_blocks": inv.traced_blocks,
                "inventory": {
                    "tracer": inv.tracer,
                    "device": inv.device,
                    "with_backward": inv.with_backward,
                    "input_shape": inv.input_shape,
                    "seconds": inv.seconds,
                    "traced_blocks": inv.traced_blocks,
                },
                "components": [
                    {
                        "module": c.module,
                        "kind": c.kind,
                        "provider": c.provider,
                        "kernel": c.kernel,
                        "status": c.status,
                        "confirmed": c.confirmed,
                        "variant": c.variant.to_dict(),
                        "note": c.note,
                        "timings_ms": c.timings,
                        "margin": c.margin,
                        "patch": c.patch,
                        "backend": c.backend,
                    }
                    for c in self.plan.components
                ],
                "ops": [
                    {
                        "overload": o.overload,
                        "count": o.count,
                        "status": o.status,
                        "core": o.core,
                        "replacement": o.replacement,
                        "modules": o.modules,
                        "flops": o.flops,
                        "recognised_flops": o.recognised_flops,
                    }
                    for o in self.plan.ops
                ],
                "coverage": self.plan.coverage(),
                "new": self.new(),
                "recognition": self.recognition.to_dict(),
                "onnx": self.onnx,
                "onnx_blocks": self.onnx_blocks,
                "generated": self.generated,
                "providers": self.plan.providers,
                "compile": self.plan.compile,
                "plan_seconds_by_kind": self.plan.seconds_by_kind,
                "patch_check": self.patch_check,
                "seconds": round(self.seconds, 3),
                "phases": {k: round(v, 3) for k, v in self.phases.items()},
                "agreement": self.agreement.to_dict() if self.agreement is not None else None,
            }
        )

    def summary(self, context: SummaryContext | None = None) -> StageSummary:
        """What the report shows of the operators stage, judged by ``operator_checks``."""
        data = _operators_data(to_jsonable(self.to_dict()))
        checks = operator_checks(data, (context or SummaryContext()).section("operators"))
        counts, coverage, patch = data["status_counts"], data["coverage"], data["patch_check"]
        unmapped = coverage.get("unmapped")
        line = (
            f"{len(data['components'])} components ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}), "
            f"{coverage.get('ops_total', '?')} ops, unmapped {unmapped if unmapped is not None else '?'}, "
            f"unsupported {unsupported_count(data)}, FLOPs on fused/native paths {pct(data['fast_flop_share'])}"
            f" (in recognised components {pct(data['recognised_flop_share'])})"
        )
        if patch.get("ran"):
            line += f", patched model {'matches' if patch.get('passed') else 'DIFFERS FROM'} unpatched"
        agreement = data["agreement"]
        if agreement is not None:  # information, not a check: a disagreement never fails the stage
            disagree = len(agreement["disagreements"])
            line += f"; intake {'disagrees on ' + plural(disagree, 'fact', 'facts') if disagree else 'agrees'}"
            line += f" ({agreement['total']} compared)"
        return StageSummary(line, data, checks)

    def verdict(self, thresholds: dict[str, Any] | None = None) -> list[Check]:
        return operator_checks(self.summary().data, thresholds)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpsReport:
        """The typed report back from ``to_dict()`` (see the module docstring for what the inventory keeps)."""
        profile = _profile(data["profile"])
        target = Target(**{**data["target"], "compute_capability": _pair(data["target"].get("compute_capability"))})
        summary = data.get("inventory") or {
            "tracer": data.get("tracer", ""),
            "traced_blocks": data.get("traced_blocks"),
        }
        inventory = OpInventory(
            ops=[],
            modules={},
            tracer=summary["tracer"],
            device=summary.get("device", ""),
            with_backward=bool(summary.get("with_backward", False)),
            input_shape=list(summary.get("input_shape") or []),
            seconds=float(summary.get("seconds") or 0.0),
            traced_blocks=list(summary.get("traced_blocks") or []),
        )
        recognised = data.get("recognition") or {}
        recognition = Recognition(
            [Component.from_dict(c) for c in recognised.get("components", [])], list(recognised.get("rejected", []))
        )
        plan = KernelPlan(
            profile=profile.to_dict(),
            target=target.to_dict(),
            components=[_choice(c) for c in data["components"]],
            ops=[OpDecision(**o) for o in data["ops"]],
            providers=data.get("providers", {}),
            compile=data.get("compile") or {"mode": "none", "reason": "not recorded"},
            seconds_by_kind=dict(data.get("plan_seconds_by_kind") or {}),
        )
        return cls(
            source=data["source"],
            profile=profile,
            target=target,
            inventory=inventory,
            recognition=recognition,
            plan=plan,
            onnx=OnnxReport(**data["onnx"]) if data.get("onnx") else None,
            generated=[GeneratedKernel(**g) for g in data.get("generated") or []],
            patch_check=PatchCheck(**data["patch_check"]) if data.get("patch_check") else None,
            seconds=float(data.get("seconds") or 0.0),
            phases=dict(data.get("phases") or {}),
            onnx_blocks=data.get("onnx_blocks"),
            agreement=Agreement.from_dict(data["agreement"]) if data.get("agreement") else None,
        )


def _choice(data: dict[str, Any]) -> KernelChoice:
    return KernelChoice(
        module=data["module"],
        kind=data["kind"],
        variant=variant_from_dict(data["kind"], data["variant"], data["module"]),
        provider=data["provider"],
        kernel=data["kernel"],
        status=data["status"],
        confirmed=data["confirmed"],
        patch=bool(data.get("patch", False)),
        note=data.get("note", ""),
        timings=data.get("timings_ms") or {},
        margin=data.get("margin"),
        backend=data.get("backend"),
    )


def _profile(data: dict[str, Any]) -> BackendProfile:
    def rules(entries: list[dict[str, Any]]) -> list[OpRule]:
        return [OpRule(r["pattern"], list(r.get("dtypes") or []), _pair(r.get("opset"))) for r in entries or []]

    return BackendProfile(
        name=data["name"],
        device=data["device"],
        codegen=data["codegen"],
        compute_capability=data.get("compute_capability"),
        description=data.get("description", ""),
        aten=rules(data.get("aten", [])),
        aten_exclude=list(data.get("aten_exclude") or []),
        onnx=rules(data.get("onnx", [])),
    )


def _pair(value: Any) -> tuple[int, int] | None:
    """JSON turns tuples into lists; compute capabilities and opset ranges are pairs again."""
    return tuple(value) if value is not None else None  # type: ignore[return-value]


def _operators_data(report: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``ops.json`` the report's tables read, with the status counts its verdict is judged on."""
    components = [
        {k: c.get(k) for k in ("module", "kind", "provider", "kernel", "status")} for c in report.get("components", [])
    ]
    return {
        "components": components,
        "status_counts": dict(Counter(c["status"] for c in components)),
        "op_status_counts": dict(Counter(o.get("status") for o in report.get("ops", []))),
        "coverage": dict(report.get("coverage") or {}),
        "fast_flop_share": num((report.get("coverage") or {}).get("flops_share_fused_or_native")),
        "recognised_flop_share": num((report.get("coverage") or {}).get("flops_share_recognised")),
        "new": report.get("new", []),
        "ops": report.get("ops", []),
        "onnx": report.get("onnx"),
        "generated": report.get("generated", []),
        "patch_check": report.get("patch_check") or {},
        "profile": (report.get("profile") or {}).get("name"),
        "agreement": report.get("agreement"),
    }
