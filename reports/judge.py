"""Re-judging a finished report against other thresholds: what ``adapt gate`` runs in CI.

Thresholds file (YAML or JSON); every section and key is optional.  A stage with a section is judged again by the
rule ``adapt run`` judged it by (``adapt.core.stage_verdicts``), with the section's limits merged over the run's
(``OPERATOR_LIMITS``, ``THROUGHPUT_LIMITS``, ``SOAK_LIMITS``; for alignment the limits the run recorded), so an empty
section gives the run's own verdict.  A stage without a section keeps the verdict it was given when it ran; the
throughput stage's decode targets are listed as checks either way (an inconclusive one passes and says why)::

    alignment:              # limits per dtype, or flat keys that apply to the report's dtype
      bf16: {min_cosine: 0.995, max_rel_err: 0.05, max_err_ratio: 1.5, rel_err_floor: 0.01}
    operators: {max_unmapped: 0, max_unsupported: 0, min_fast_flop_share: 0.6}
    throughput: {min_speedup: 1.0,        # adapted / baseline, every measurement
                 min_decode_vs_static_compile: 1.0, min_decode_vs_eager: 3.0}  # decode targets, every batch
    soak: {max_step_time_cv: 0.3, allow_leak: false}
    ignore: [throughput]                  # stages whose result does not gate the build

The alignment rule is the validators' rule (``adapt.core.verdicts.Thresholds``): a tensor passes
when it is finite, ``cosine >= min_cosine``, ``rel_err <= max_rel_err`` and
``rel_err <= max_err_ratio * baseline_rel_err + rel_err_floor``; gradients within the widened limits of
``gradient_thresholds``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapt.core.errors import BadInput
from adapt.core.inputs import read_input_text
from adapt.core.stage_verdicts import (
    STAGE_CHECKS,
    THRESHOLD_KEYS,
    Check,
    decode_checks,
    first_divergent,
    recorded_decode_targets,
)
from adapt.core.verdicts import DEFAULT_THRESHOLDS
from reports.schema import summary

_SECTIONS = THRESHOLD_KEYS
_DTYPES = tuple(DEFAULT_THRESHOLDS)


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
    text = read_input_text(path, "thresholds")
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
        if number is None or math.isnan(number):  # a NaN limit passes or fails every comparison
            raise BadInput(f"{path}: {where}.{key} must be a number (not NaN) or a boolean, got {value!r}")
        checked[key] = number
    return checked


def _as_float(value: Any) -> float | None:
    """PyYAML reads ``1.0e9`` (no exponent sign) as a string; accept any string that is a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def rejudge(report: dict[str, Any], thresholds: dict[str, Any]) -> GateResult:
    """Judge every stage of ``report``: a stage with a section in ``thresholds`` by its stage's rule
    (``adapt.core.stage_verdicts``, the one ``adapt run`` judged it by) with that section merged over the run's
    limits; a stage without one keeps the status it was given when it ran."""
    ignored = set(thresholds.get("ignore", []))
    checks: list[Check] = []
    divergent = None
    for entry in report["stages"]:
        name, status = entry["name"], entry["status"]
        if name in ignored or status == "skipped":
            checks.append(Check(name, "stage", True, "ignored by thresholds" if name in ignored else "skipped"))
            continue
        if status not in ("passed", "failed"):
            checks.append(Check(name, "stage", False, f"{status}: {entry.get('verdict', '')}"))
            continue
        data = summary(report, name)
        if name in thresholds and name in STAGE_CHECKS:
            stage_checks = STAGE_CHECKS[name](data, thresholds[name])
            checks += stage_checks
            if name == "alignment":
                divergent = first_divergent(data, stage_checks)
        else:
            checks.append(Check(name, "stage", status == "passed", entry.get("verdict", "")))
            if name == "throughput":
                checks += decode_checks(recorded_decode_targets(data))
            if name == "alignment":
                divergent = data.get("first_divergent")
    return GateResult(all(c.passed for c in checks), checks, divergent)


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
