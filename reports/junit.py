"""junit.xml: one test case per stage, per aligned block/component and per mapped component.

CI systems (GitHub, GitLab, Jenkins) show each failing case by name, so a broken kernel shows
up as e.g. ``adapt.alignment.block1 :: model.layers.1.mlp`` rather than "the run failed".
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from reports.schema import summary
from reports.tables import format_number

_METRICS = ("cosine", "rel_err", "max_abs", "err_ratio", "baseline_rel_err")


def render_junit(report: dict[str, Any]) -> str:
    root = ET.Element("testsuites", name=f"adapt {report['source'].get('text', '')}")
    _stage_suite(root, report)
    _alignment_suite(root, report)
    _operator_suite(root, report)
    for attr in ("tests", "failures", "errors", "skipped"):
        root.set(attr, str(sum(int(s.get(attr, 0)) for s in root)))
    root.set("time", f"{sum(float(s.get('time', 0)) for s in root):.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _suite(root: ET.Element, name: str) -> ET.Element:
    return ET.SubElement(root, "testsuite", name=name, tests="0", failures="0", errors="0", skipped="0", time="0")


def _case(suite: ET.Element, classname: str, name: str, time_s: float = 0.0) -> ET.Element:
    suite.set("tests", str(int(suite.get("tests")) + 1))
    suite.set("time", f"{float(suite.get('time')) + time_s:.3f}")
    return ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{time_s:.3f}")


def _mark(suite: ET.Element, case: ET.Element, kind: str, message: str, text: str = "") -> None:
    counter = {"failure": "failures", "error": "errors", "skipped": "skipped"}[kind]
    suite.set(counter, str(int(suite.get(counter)) + 1))
    element = ET.SubElement(case, kind, message=message)
    if text:
        element.text = text


def _stage_suite(root: ET.Element, report: dict[str, Any]) -> None:
    suite = _suite(root, "adapt.stages")
    for entry in report["stages"]:
        case = _case(suite, "adapt.stages", entry["name"], float(entry.get("duration_s") or 0.0))
        status, verdict = entry["status"], entry.get("verdict", "")
        if status == "failed":
            _mark(suite, case, "failure", verdict)
        elif status in ("error", "blocked", "interrupted"):
            _mark(suite, case, "error", f"{status}: {verdict}", entry.get("error") or "")
        elif status in ("skipped", "pending"):
            _mark(suite, case, "skipped", f"{status}: {verdict}")
        else:
            ET.SubElement(case, "system-out").text = verdict + (" (cached)" if entry.get("cached") else "")


def _alignment_suite(root: ET.Element, report: dict[str, Any]) -> None:
    align = summary(report, "alignment")
    if not align.get("layers"):
        return
    suite = _suite(root, "adapt.alignment")
    first = align.get("first_divergent")
    for layer in align["layers"]:
        block = layer.get("block")
        classname = "adapt.alignment" + (f".block{block}" if block is not None else "")
        case = _case(suite, classname, str(layer.get("name")))
        metrics = ", ".join(f"{k}={format_number(layer.get(k))}" for k in _METRICS if k in layer)
        if not layer.get("passed"):
            prefix = "first divergent; " if layer.get("name") == first else ""
            _mark(suite, case, "failure", f"{prefix}{layer.get('name')} outside {align.get('dtype')} limits: {metrics}")
        else:
            ET.SubElement(case, "system-out").text = metrics


def _operator_suite(root: ET.Element, report: dict[str, Any]) -> None:
    components = summary(report, "operators").get("components", [])
    if not components:
        return
    suite = _suite(root, "adapt.operators")
    for comp in components:
        case = _case(suite, f"adapt.operators.{comp.get('kind')}", str(comp.get("module")))
        detail = f"{comp.get('kind')} -> {comp.get('provider')}:{comp.get('kernel')} ({comp.get('status')})"
        if comp.get("status") == "unsupported":
            _mark(suite, case, "failure", f"no kernel for {detail} on this profile")
        else:
            ET.SubElement(case, "system-out").text = detail
