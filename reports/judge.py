"""Re-judging a finished report against other thresholds: what ``adapt gate`` runs in CI.

Thresholds file (YAML or JSON); every section and key is optional.  A stage without a section
keeps the verdict it was given when it ran; the throughput stage's decode targets are listed as checks
either way (an inconclusive one passes and says why)::

    alignment:              # limits per dtype, or flat keys that apply to the report's dtype
      bf16: {min_cosine: 0.995, max_rel_err: 0.05, max_err_ratio: 1.5, rel_err_floor: 0.01}
    operators: {max_unmapped: 0, max_unsupported: 0, min_fast_flop_share: 0.6}
    throughput: {min_speedup: 1.0,        # adapted / baseline, every measurement
                 min_decode_vs_static_compile: 1.0, min_decode_vs_eager: 3.0}  # decode targets, every batch
    soak: {max_step_time_cv: 0.3, allow_leak: false}
    ignore: [throughput]                  # stages whose result does not gate the build

The alignment rule is the validators' rule (``validators.compare.Thresholds``): a tensor passes
when it is finite, ``cosine >= min_cosine``, ``rel_err <= max_rel_err`` and
``rel_err <= max_err_ratio * baseline_rel_err + rel_err_floor``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapt.core.errors import BadInput
from adapt.core.verdicts import STAGE_DECODE_MINIMA, decode_targets
from reports.schema import summary

DECODE_TARGET_KEYS = {name.removeprefix("hf-").replace("-", "_"): name for name in STAGE_DECODE_MINIMA}

_SECTIONS = {
    "alignment": {"min_cosine", "max_rel_err", "max_err_ratio", "rel_err_floor", "allow_dtype_cost"},
    "operators": {"max_unmapped", "max_unsupported", "min_fast_flop_share"},
    "throughput": {"min_speedup", *(f"min_decode_vs_{key}" for key in DECODE_TARGET_KEYS)},
    "soak": {"max_step_time_cv", "allow_leak"},
}
_DTYPES = ("fp32", "bf16", "fp16")


@dataclass
class Check:
    stage: str
    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GateResult:
    passed: bool
    checks: list[Check] = field(default_factory=list)
    first_divergent: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "first_divergent": self.first_divergent,
            "checks": [c.to_dict() for c in self.checks],
        }


def load_thresholds(path: str | Path | None) -> dict[str, Any]:
    """Read and validate a thresholds file; unknown sections or keys are bad input (typos must not pass)."""
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: no such thresholds file")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as err:
        raise BadInput(f"{path}: cannot parse thresholds ({err})") from err
    data = data or {}
    if not isinstance(data, dict):
        raise BadInput(f"{path}: thresholds must be a mapping of sections")
    return {section: _check_section(path, section, values) for section, values in data.items()}


def _check_section(path: Path, section: str, values: Any) -> Any:
    """One validated section with every limit as a number (per-dtype alignment mappings kept nested)."""
    if section == "ignore":
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise BadInput(f"{path}: 'ignore' must be a list of stage names")
        return values
    if section not in _SECTIONS:
        raise BadInput(f"{path}: unknown section {section!r}; known: {', '.join([*_SECTIONS, 'ignore'])}")
    if not isinstance(values, dict):
        raise BadInput(f"{path}: section {section!r} must be a mapping")
    if section == "alignment":
        return {
            key: _check_limits(path, f"alignment.{key}", value, _SECTIONS[section])
            if key in _DTYPES and isinstance(value, dict)
            else _check_limits(path, section, {key: value}, _SECTIONS[section])[key]
            for key, value in values.items()
        }
    return _check_limits(path, section, values, _SECTIONS[section])


def _check_limits(path: Path, where: str, values: dict[str, Any], known: set[str]) -> dict[str, Any]:
    unknown = set(values) - known
    if unknown:
        raise BadInput(f"{path}: unknown key(s) in {where}: {', '.join(sorted(unknown))}")
    checked = {}
    for key, value in values.items():
        number = value if isinstance(value, (int, float)) else _as_float(value)
        if number is None:
            raise BadInput(f"{path}: {where}.{key} must be a number or boolean, got {value!r}")
        checked[key] = number
    return checked


def _as_float(value: Any) -> float | None:
    """PyYAML reads ``1.0e9`` (no exponent sign) as a string; accept any string that is a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def rejudge(report: dict[str, Any], thresholds: dict[str, Any]) -> GateResult:
    """Judge every stage of ``report``; sections present in ``thresholds`` are recomputed from the raw numbers."""
    ignored = set(thresholds.get("ignore", []))
    checks: list[Check] = []
    first_divergent = None
    for entry in report["stages"]:
        name, status = entry["name"], entry["status"]
        if name in ignored or status == "skipped":
            checks.append(Check(name, "stage", True, "ignored by thresholds" if name in ignored else "skipped"))
            continue
        if status not in ("passed", "failed"):
            checks.append(Check(name, "stage", False, f"{status}: {entry.get('verdict', '')}"))
            continue
        if name == "alignment" and "alignment" in thresholds:
            layer_checks, first_divergent = _alignment(report, thresholds["alignment"])
            checks += layer_checks
        elif name in thresholds and name in _JUDGES:
            checks += _JUDGES[name](summary(report, name), thresholds[name])
        else:
            checks.append(Check(name, "stage", status == "passed", entry.get("verdict", "")))
            if name == "throughput":
                checks += decode_checks(recorded_decode_targets(summary(report, name)))
            if name == "alignment":
                first_divergent = summary(report, "alignment").get("first_divergent")
    return GateResult(all(c.passed for c in checks), checks, first_divergent)


def _num(value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, str):
        return float(value)  # "inf" / "-inf" as the validators encode them
    return float(value)


def alignment_limits(section: dict[str, Any], dtype: str) -> dict[str, float]:
    """Flat keys of an ``alignment`` section, overridden by its per-dtype mapping for ``dtype``."""
    limits = {k: v for k, v in section.items() if k not in _DTYPES}
    if isinstance(section.get(dtype), dict):
        limits.update(section[dtype])
    return limits


def _alignment(report: dict[str, Any], section: dict[str, Any]) -> tuple[list[Check], str | None]:
    align = summary(report, "alignment")
    dtype = align.get("dtype")
    limits = {**(align.get("thresholds") or {}), **alignment_limits(section, dtype)}
    missing = _SECTIONS["alignment"] - {"allow_dtype_cost"} - set(limits)
    if missing:
        raise BadInput(
            f"alignment thresholds for {dtype} lack {', '.join(sorted(missing))} and the report does not state them"
        )
    checks, first = [], None
    for layer in align.get("layers", []):
        check = _tensor_check("alignment", layer, limits)
        if not check.passed and first is None:
            first = check.name
        checks.append(check)
    checks += [_tensor_check("alignment.gradients", grad, limits) for grad in align.get("gradients", [])]
    parity = align.get("parity")
    if parity:  # the loss-curve parity run keeps its own tolerance
        detail = f"max relative loss difference {parity.get('max_rel_diff')} (tolerance {parity.get('tolerance')})"
        checks.append(Check("alignment", "loss_parity", bool(parity.get("passed")), detail))
    if align.get("nonfinite_module"):
        checks.append(Check("alignment", "nonfinite", False, f"NaN/Inf produced by {align['nonfinite_module']}"))
        first = first or align["nonfinite_module"]
    return checks, first


def _tensor_check(stage: str, tensor: dict[str, Any], limits: dict[str, float]) -> Check:
    """The validators' own rule (``validators.compare.verdict``) on one captured tensor; NaN/Inf fails."""
    from adapt.core.verdicts import Thresholds, verdict

    cosine, rel, base = _num(tensor.get("cosine")), _num(tensor.get("rel_err")), _num(tensor.get("baseline_rel_err"))
    rule = Thresholds(
        **{k: float(limits[k]) for k in ("min_cosine", "max_rel_err", "max_err_ratio", "rel_err_floor")},
        allow_dtype_cost=bool(limits.get("allow_dtype_cost", True)),
    )
    ok = verdict(cosine, rel, base, rule, bool(tensor.get("negligible", False)))
    return Check(stage, str(tensor.get("name")), ok, f"cosine={cosine:.6g} rel_err={rel:.3e} baseline={base:.3e}")


def _operators(ops: dict[str, Any], section: dict[str, Any]) -> list[Check]:
    checks = []
    coverage = ops.get("coverage", {})
    if "max_unmapped" in section:
        unmapped = coverage.get("unmapped")
        ok = unmapped is not None and unmapped <= section["max_unmapped"]
        checks.append(Check("operators", "unmapped", ok, f"unmapped={unmapped} (max {section['max_unmapped']})"))
    if "max_unsupported" in section:
        count = ops.get("status_counts", {}).get("unsupported", 0) + ops.get("op_status_counts", {}).get(
            "unsupported", 0
        )
        checks.append(
            Check(
                "operators",
                "unsupported",
                count <= section["max_unsupported"],
                f"unsupported components and ops={count}",
            )
        )
    if "min_fast_flop_share" in section:
        share = ops.get("fast_flop_share")
        ok = share is not None and share >= section["min_fast_flop_share"]
        checks.append(Check("operators", "fast_flop_share", ok, f"fused/native FLOP share={share}"))
    return checks


RATE_UNITS = ("tokens/s", "fraction")  # rows where adapted/baseline is a speed-up; times and memory are not


def _throughput(tp: dict[str, Any], section: dict[str, Any]) -> list[Check]:
    """``min_speedup`` judges the rows that measure a rate; a rate row without a speed-up fails (not measured)."""
    checks = []
    for row in tp.get("rows", []):
        if "speedup" not in row and row.get("unit") not in RATE_UNITS:
            continue  # step time, peak memory: reported, not a speed-up
        speedup = row.get("speedup")
        ok = speedup is not None and speedup >= section.get("min_speedup", 0.0)
        checks.append(
            Check("throughput", str(row.get("metric")), ok, f"speedup={speedup} (min {section.get('min_speedup')})")
        )
    recorded = {key: row.get(f"min_vs_{key}") for row in recorded_decode_targets(tp) for key in DECODE_TARGET_KEYS}
    minima = {
        name: float(section.get(f"min_decode_vs_{key}", recorded.get(key) or STAGE_DECODE_MINIMA[name]))
        for key, name in DECODE_TARGET_KEYS.items()
    }
    on_gpu = str(tp.get("device", "")).startswith("cuda")
    return checks + decode_checks(decode_targets(tp.get("decode") or [], on_gpu, minima))


def recorded_decode_targets(tp: dict[str, Any]) -> list[dict[str, Any]]:
    """The decode target rows of a throughput summary; judged from its decode timings when it predates them."""
    if tp.get("decode_targets"):
        return tp["decode_targets"]
    return decode_targets(tp.get("decode") or [], str(tp.get("device", "")).startswith("cuda"), STAGE_DECODE_MINIMA)


def decode_checks(targets: list[dict[str, Any]]) -> list[Check]:
    """One check per batch and target: fails only on a measured miss; an inconclusive one passes and says why."""
    checks = []
    for row in targets:
        for key, name in DECODE_TARGET_KEYS.items():
            verdict = row.get(f"{key}_verdict")
            if verdict is None:
                continue
            ratio = row.get(f"vs_{key}")
            detail = (
                f"{verdict}: adapted {_rate(row.get('adapted_tokens_per_s'))} tok/s, {name} "
                f"{_rate(row.get(f'{key}_tokens_per_s'))} tok/s, "
                f"ratio {'n/a' if ratio is None else f'{ratio:.3f}'} (min {row.get(f'min_vs_{key}')})"
            )
            checks.append(Check("throughput", f"decode batch {row['batch']} vs {name}", verdict != "failed", detail))
    return checks


def _rate(value: Any) -> str:
    return "n/a" if not isinstance(value, (int, float)) else f"{value:,.1f}"


def _soak(soak: dict[str, Any], section: dict[str, Any]) -> list[Check]:
    checks = [Check("soak", "loss_finite", bool(soak.get("loss_finite")), f"loss finite: {soak.get('loss_finite')}")]
    if "max_step_time_cv" in section:
        cv = soak.get("step_time_cv")
        ok = cv is not None and cv <= section["max_step_time_cv"]
        checks.append(Check("soak", "step_time_cv", ok, f"step-time CV={cv} (max {section['max_step_time_cv']})"))
    if not section.get("allow_leak", False):
        leak = soak.get("leak")
        leaking = bool(leak.get("leaking", leak.get("leak"))) if isinstance(leak, dict) else bool(leak)
        checks.append(Check("soak", "memory_leak", not leaking, f"leak: {leak}"))
    return checks


_JUDGES = {"operators": _operators, "throughput": _throughput, "soak": _soak}


def render_gate_junit(report: dict[str, Any], result: GateResult) -> str:
    """The gate's checks as JUnit XML: one test case per check, classname ``adapt.gate.<stage>``."""
    import xml.etree.ElementTree as ET

    failures = sum(not c.passed for c in result.checks)
    root = ET.Element("testsuites", name="adapt gate", tests=str(len(result.checks)), failures=str(failures))
    suite = ET.SubElement(root, "testsuite", name="adapt.gate", tests=str(len(result.checks)), failures=str(failures))
    for check in result.checks:
        case = ET.SubElement(suite, "testcase", classname=f"adapt.gate.{check.stage}", name=check.name)
        if check.passed:
            ET.SubElement(case, "system-out").text = check.detail
        else:
            ET.SubElement(case, "failure", message=check.detail)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
