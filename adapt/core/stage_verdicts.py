"""Every stage's pass rule, on the summary that lands in ``report.json``: ``adapt run`` and ``adapt gate`` judge with
these same functions, so a run's pass flag and the gate's can only differ where a thresholds file says they should.

Each stage's result type builds its summary (``summary(context) -> StageSummary``) and judges it
(``verdict(thresholds) -> list[Check]``) through the rule here; a stage passes when every check passes.  The limits a
run uses when nothing overrides them are the named defaults below; a thresholds section is merged over them.  Plain
Python, so the reports layer re-judges a finished report without importing torch or the stages' packages.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from adapt.core.errors import BadInput
from adapt.core.verdicts import (
    DEFAULT_THRESHOLDS,
    STAGE_DECODE_MINIMA,
    Thresholds,
    decode_targets,
    gradient_thresholds,
    verdict,
)

# ---- the limits a run judges with, unless a thresholds file overrides them ----------------------------------------

# None: not judged unless a thresholds file sets it.
OPERATOR_LIMITS: dict[str, float | None] = {"max_unmapped": 0, "max_unsupported": 0, "min_fast_flop_share": None}
# the decode target keys of a thresholds file ("min_decode_vs_eager") -> the HF path they compare against
DECODE_TARGET_KEYS: dict[str, str] = {name.removeprefix("hf-").replace("-", "_"): name for name in STAGE_DECODE_MINIMA}
THROUGHPUT_LIMITS: dict[str, float | None] = {
    "min_speedup": None,  # adapted over eager, per rate row
    **{f"min_decode_vs_{key}": STAGE_DECODE_MINIMA[name] for key, name in DECODE_TARGET_KEYS.items()},
}
SOAK_LIMITS: dict[str, float | bool | None] = {"max_step_time_cv": None, "allow_leak": False}
ALIGNMENT_KEYS = tuple(f.name for f in dataclasses.fields(Thresholds))  # defaults: the dtype's DEFAULT_THRESHOLDS
# A part (train step, prefill, decode) whose adapted rate is below 98% of the best baseline's is slower: run-to-run
# noise allowance.  Judged on a GPU only: on a CPU the rates time the host, not the kernels.
SLOWER_TOLERANCE = 0.02
RATE_UNITS = ("tokens/s", "fraction")  # throughput rows where adapted/baseline is a speed-up; times and memory are not


@dataclass(frozen=True)
class Check:
    """One judged condition of a stage, as ``adapt gate`` lists it (and JUnit renders it)."""

    stage: str
    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class StageSummary:
    """A stage's normalised summary (the report's tables read ``data``), its one-line verdict, and the checks its
    rule made of ``data``: the stage passes when every check passes."""

    verdict: str  # one line
    data: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return judged(self.checks)


@dataclass(frozen=True)
class SummaryContext:
    """The run facts a summary states beside a stage's own result (shapes it was given, the cluster asked for) and
    the thresholds file's sections the run judges with; built by the app from its options."""

    device: str = "cpu"
    dtype: str = "fp32"
    seq_len: int | None = None
    batch_size: int | None = None
    cluster: str = ""
    local_cluster: bool = False  # ``cluster`` is this machine, measured: its label names the GPUs
    plan_seq_len: int | None = None
    plan_global_batch: int | None = None
    precision: str | None = None
    thresholds: Mapping[str, Any] = field(default_factory=dict)  # a parsed thresholds file (reports.judge)

    def section(self, stage: str) -> Mapping[str, Any] | None:
        return self.thresholds.get(stage)


def judged(checks: list[Check]) -> bool:
    return all(c.passed for c in checks)


# ---- formatting shared by the summaries -----------------------------------------------------------------------------


def num(value: Any) -> float | None:
    """A JSON number, or the validators' "inf"/None encodings of non-finite values."""
    if isinstance(value, bool) or value is None:
        return None if value is None else float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("inf", "-inf", "nan"):
        return float(value)
    return None


def pct(share: float | None) -> str:
    return "n/a" if share is None or math.isnan(share) else f"{100 * share:.0f}%"


def fmt(value: Any, spec: str) -> str:
    number = num(value)
    return "?" if number is None else format(number, spec)


def plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _merged(defaults: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    return {**defaults, **(overrides or {})}


# ---- the stages without a thresholds section: their own measured verdict --------------------------------------------


def intake_checks(data: dict[str, Any], overrides: Mapping[str, Any] | None = None) -> list[Check]:
    """Only what would make the model wrong fails: tensors the model needs that the checkpoint lacks."""
    problems = data.get("checkpoint_problems") or []
    detail = "; ".join(problems) if problems else "every tensor the model needs is in the checkpoint"
    return [Check("intake", "checkpoint", not problems, detail)]


def plan_checks(data: dict[str, Any], overrides: Mapping[str, Any] | None = None) -> list[Check]:
    fits = data.get("best") is not None and bool(data.get("fits", True))
    detail = f"best layout fits {data.get('cluster')}" if fits else f"no layout fits: {data.get('binding_constraint')}"
    return [Check("plan", "fits", fits, detail)]


def replan_checks(data: dict[str, Any], overrides: Mapping[str, Any] | None = None) -> list[Check]:
    """A measurement that does not apply to the plan's target is no failure: the re-plan says why."""
    return [Check("replan", "replan", True, str(data.get("reason")))]


def environment_checks(data: dict[str, Any], overrides: Mapping[str, Any] | None = None) -> list[Check]:
    problems = data.get("problems") or []
    return [Check("environment", "problems", not problems, "; ".join(problems) or "no problem found")]


def generation_checks(data: dict[str, Any], overrides: Mapping[str, Any] | None = None) -> list[Check]:
    """The generation check's own outcome: a model that cannot generate is not applicable, not failed."""
    outcome = data.get("verdict")
    return [Check("generation", "generation", outcome in ("passed", "not applicable"), str(outcome))]


# ---- operators --------------------------------------------------------------------------------------------------


def unsupported_count(data: dict[str, Any]) -> int:
    """Components and leftover ops that no provider runs on the profile."""
    return (data.get("status_counts") or {}).get("unsupported", 0) + (data.get("op_status_counts") or {}).get(
        "unsupported", 0
    )


def operator_checks(data: dict[str, Any], overrides: Mapping[str, Any] | None = None) -> list[Check]:
    limits = _merged(OPERATOR_LIMITS, overrides)
    unmapped = (data.get("coverage") or {}).get("unmapped")
    ok = unmapped is not None and unmapped <= limits["max_unmapped"]
    checks = [Check("operators", "unmapped", ok, f"unmapped={unmapped} (max {limits['max_unmapped']})")]
    count = unsupported_count(data)
    detail = f"unsupported components and ops={count} (max {limits['max_unsupported']})"
    checks.append(Check("operators", "unsupported", count <= limits["max_unsupported"], detail))
    if limits["min_fast_flop_share"] is not None:
        share = data.get("fast_flop_share")
        ok = share is not None and share >= limits["min_fast_flop_share"]
        detail = f"fused/native FLOP share={share} (min {limits['min_fast_flop_share']})"
        checks.append(Check("operators", "fast_flop_share", ok, detail))
    patch = data.get("patch_check") or {}
    if patch.get("ran"):
        ok = bool(patch.get("passed"))
        checks.append(
            Check("operators", "patch_check", ok, f"patched model {'matches' if ok else 'differs from'} unpatched")
        )
    return checks


# ---- alignment ----------------------------------------------------------------------------------------------------


def alignment_limits(section: Mapping[str, Any], dtype: str) -> dict[str, float]:
    """Flat keys of an ``alignment`` thresholds section, overridden by its per-dtype mapping for ``dtype``."""
    limits = {k: v for k, v in section.items() if k not in DEFAULT_THRESHOLDS}
    if isinstance(section.get(dtype), Mapping):
        limits.update(section[dtype])
    return limits


def _alignment_rule(data: dict[str, Any], overrides: Mapping[str, Any] | None) -> Thresholds:
    """The limits the run recorded (else the dtype's defaults), with a thresholds section merged over them."""
    dtype = data.get("dtype")
    default = DEFAULT_THRESHOLDS[dtype].to_dict() if dtype in DEFAULT_THRESHOLDS else {}
    limits = {**default, **(data.get("thresholds") or {}), **alignment_limits(overrides or {}, dtype)}
    missing = set(ALIGNMENT_KEYS) - {"allow_dtype_cost"} - set(limits)
    if missing:
        raise BadInput(
            f"alignment thresholds for {dtype} lack {', '.join(sorted(missing))} and the report does not state them"
        )
    return Thresholds(
        **{k: float(limits[k]) for k in ("min_cosine", "max_rel_err", "max_err_ratio", "rel_err_floor")},
        allow_dtype_cost=bool(limits.get("allow_dtype_cost", True)),
    )


def _nan(value: Any) -> float:
    number = num(value)
    return math.nan if number is None else number


def _tensor_check(stage: str, tensor: dict[str, Any], rule: Thresholds) -> Check:
    """The validators' own rule (``adapt.core.verdicts.verdict``) on one captured tensor; NaN/Inf fails."""
    cosine, rel, base = _nan(tensor.get("cosine")), _nan(tensor.get("rel_err")), _nan(tensor.get("baseline_rel_err"))
    ok = verdict(cosine, rel, base, rule, bool(tensor.get("negligible", False)))
    return Check(stage, str(tensor.get("name")), ok, f"cosine={cosine:.6g} rel_err={rel:.3e} baseline={base:.3e}")


def alignment_checks(data: dict[str, Any], overrides: Mapping[str, Any] | None = None) -> list[Check]:
    """Every tensor and gradient within the limits (gradients' widened as the validator widens them), the loss
    parity run within its own tolerance, nothing non-finite, and a conclusive comparison of at least one tensor."""
    rule = _alignment_rule(data, overrides)
    checks = [_tensor_check("alignment", layer, rule) for layer in data.get("layers") or []]
    grad_rule = gradient_thresholds(rule)
    checks += [_tensor_check("alignment.gradients", grad, grad_rule) for grad in data.get("gradients") or []]
    parity = data.get("parity")
    if parity:  # the loss-curve parity run keeps its own tolerance
        detail = f"max relative loss difference {parity.get('max_rel_diff')} (tolerance {parity.get('tolerance')})"
        checks.append(Check("alignment", "loss_parity", bool(parity.get("passed")), detail))
    if data.get("nonfinite_module"):
        checks.append(Check("alignment", "nonfinite", False, f"NaN/Inf produced by {data['nonfinite_module']}"))
    why_not = data.get("inconclusive") or (None if data.get("layers") else "no tensor was judged")
    checks.append(Check("alignment", "conclusive", why_not is None, why_not or "the comparison is conclusive"))
    return checks


def first_divergent(data: dict[str, Any], checks: list[Check]) -> str | None:
    """The first tensor that failed (a block output before a gradient), else the module that produced NaN/Inf."""
    for stage in ("alignment", "alignment.gradients"):
        names = {str(t.get("name")) for t in data.get("layers" if stage == "alignment" else "gradients") or []}
        failed = next((c.name for c in checks if c.stage == stage and not c.passed and c.name in names), None)
        if failed is not None:
            return failed
    return data.get("nonfinite_module")


# ---- throughput -----------------------------------------------------------------------------------------------------


def slower_than_best(ratio: float) -> bool:
    """Adapted over the best baseline's rate: slower by more than the noise allowance."""
    return ratio < 1 - SLOWER_TOLERANCE


def recorded_decode_targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The decode target rows of a throughput summary; judged from its decode timings when it predates them."""
    if data.get("decode_targets"):
        return data["decode_targets"]
    return decode_targets(data.get("decode") or [], str(data.get("device", "")).startswith("cuda"), STAGE_DECODE_MINIMA)


def _rate(value: Any) -> str:
    return "n/a" if not isinstance(value, (int, float)) else f"{value:,.1f}"


def decode_checks(targets: list[dict[str, Any]]) -> list[Check]:
    """One check per batch and target: fails only on a measured miss; an inconclusive one passes and says why."""
    checks = []
    for row in targets:
        for key, name in DECODE_TARGET_KEYS.items():
            outcome = row.get(f"{key}_verdict")
            if outcome is None:
                continue
            ratio = row.get(f"vs_{key}")
            detail = (
                f"{outcome}: adapted {_rate(row.get('adapted_tokens_per_s'))} tok/s, {name} "
                f"{_rate(row.get(f'{key}_tokens_per_s'))} tok/s, "
                f"ratio {'n/a' if ratio is None else f'{ratio:.3f}'} (min {row.get(f'min_vs_{key}')})"
            )
            checks.append(Check("throughput", f"decode batch {row['batch']} vs {name}", outcome != "failed", detail))
    return checks


def throughput_checks(data: dict[str, Any], overrides: Mapping[str, Any] | None = None) -> list[Check]:
    """Every variant measured a finite rate; on a GPU, no part slower than its best baseline and every decode target
    met (the minima a report recorded stand unless overridden); ``min_speedup`` when set, on every rate row."""
    recorded = {
        f"min_decode_vs_{key}": row[f"min_vs_{key}"]
        for row in data.get("decode_targets") or []
        for key in DECODE_TARGET_KEYS
        if row.get(f"min_vs_{key}") is not None
    }
    limits = {**THROUGHPUT_LIMITS, **recorded, **(overrides or {})}
    on_gpu = str(data.get("device", "")).startswith("cuda")
    checks = []
    ratios = data.get("vs_best_baseline")
    if ratios is None:  # a report from before the parts were kept: the measurement's own verdict
        outcome = data.get("verdict")
        checks.append(Check("throughput", "measured", outcome != "failed", f"measured verdict: {outcome}"))
    else:
        finite = bool(data.get("finite", True))
        detail = "every variant measured a rate and finite losses"
        detail = detail if finite else "a variant produced no rate or a non-finite loss"
        checks.append(Check("throughput", "finite", finite, detail))
        for part, ratio in ratios.items():
            if part == "decode" and data.get("decode"):
                continue  # the serving paths' decode targets judge decode
            ok = not on_gpu or not slower_than_best(ratio)
            detail = f"x{ratio:.3f} of the best baseline (min x{1 - SLOWER_TOLERANCE:g}" + ("" if on_gpu else "; a CPU")
            checks.append(Check("throughput", f"{part} vs best baseline", ok, detail + ")"))
    if limits["min_speedup"] is not None:
        for row in data.get("rows") or []:
            if "speedup" not in row and row.get("unit") not in RATE_UNITS:
                continue  # step time, peak memory: reported, not a speed-up
            speedup = row.get("speedup")  # a rate row without one fails: not measured
            ok = speedup is not None and speedup >= limits["min_speedup"]
            detail = f"speedup={speedup} (min {limits['min_speedup']})"
            checks.append(Check("throughput", str(row.get("metric")), ok, detail))
    minima = {name: float(limits[f"min_decode_vs_{key}"]) for key, name in DECODE_TARGET_KEYS.items()}
    return checks + decode_checks(decode_targets(data.get("decode") or [], on_gpu, minima))


# ---- soak -------------------------------------------------------------------------------------------------------------


def soak_checks(data: dict[str, Any], overrides: Mapping[str, Any] | None = None) -> list[Check]:
    limits = _merged(SOAK_LIMITS, overrides)
    finite = data.get("loss_finite")
    checks = [Check("soak", "loss_finite", bool(finite), f"loss finite: {finite}")]
    if limits["max_step_time_cv"] is not None:
        cv = data.get("step_time_cv")
        ok = cv is not None and cv <= limits["max_step_time_cv"]
        checks.append(Check("soak", "step_time_cv", ok, f"step-time CV={cv} (max {limits['max_step_time_cv']})"))
    if not limits["allow_leak"]:
        leak = data.get("leak")
        leaking = bool(leak.get("leaking", leak.get("leak"))) if isinstance(leak, dict) else bool(leak)
        checks.append(Check("soak", "memory_leak", not leaking, f"leak: {leak}"))
    return checks


Rule = Callable[[dict[str, Any], "Mapping[str, Any] | None"], list[Check]]
STAGE_CHECKS: dict[str, Rule] = {
    "intake": intake_checks,
    "operators": operator_checks,
    "plan": plan_checks,
    "replan": replan_checks,
    "environment": environment_checks,
    "alignment": alignment_checks,
    "generation": generation_checks,
    "throughput": throughput_checks,
    "soak": soak_checks,
}
# The stages a thresholds file may set limits for, with the keys each section accepts.
THRESHOLD_KEYS: dict[str, frozenset[str]] = {
    "alignment": frozenset(ALIGNMENT_KEYS),
    "operators": frozenset(OPERATOR_LIMITS),
    "throughput": frozenset(THROUGHPUT_LIMITS),
    "soak": frozenset(SOAK_LIMITS),
}
