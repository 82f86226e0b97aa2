"""The plan before and after this machine's measurements, side by side in report.md, report.html and report.json."""

from __future__ import annotations

import json
import random

from adapt.app.pipeline.options import RunOptions
from adapt.app.pipeline.stages import summary_context
from adapt.core.jsonio import to_jsonable
from adapt.core.spec import ModelSpec
from parallel_planner.calibration import calibration_from_measurements
from parallel_planner.replan import CalibratedPlan, replan
from parallel_planner.result import PlannerResult
from reports.html import render_html
from reports.markdown import render_markdown
from reports.schema import stage, summary
from reports.tables import format_number


def _calibrated(report: dict, device: str) -> dict:
    """``report`` with its replan stage recomputed from a measurement taken on ``device``."""
    spec = ModelSpec.from_dict(stage(report, "intake")["result"])
    before = PlannerResult.from_dict(stage(report, "plan")["result"])
    rate = random.uniform(2e5, 6e5)
    layout = {"tp": 1, "pp": 1, "cp": 1, "zero": 0, "recompute": "none", "mbs": 4}
    run = {
        "gpus": 1,
        "layout": layout,
        "seq_len": 2048,
        "global_batch": 4,
        "tokens_per_s": rate,
        "peak_memory_gib": 7.5,
    }
    measured = calibration_from_measurements(device, 700.0, 989.0, None, [run])
    raw = to_jsonable(replan(spec, before, measured).to_dict())
    options = RunOptions.from_dict({"source": "x", "out_dir": "y", "cluster": report["options"]["cluster"]})
    entry = stage(report, "replan")
    entry["result"], entry["summary"] = raw, CalibratedPlan.from_dict(raw).summary(summary_context(options)).data
    return json.loads(json.dumps(report))  # what report.json holds


def test_an_applied_calibration_shows_both_plans_and_what_changed(report):
    report = _calibrated(report, "NVIDIA H100 80GB HBM3")
    replanned = summary(report, "replan")
    assert replanned["applied"] and replanned["after"]["step_time_s"] != replanned["before"]["step_time_s"]
    text = render_markdown(report)
    assert "### Before and after calibration" in text
    assert "| figure | before calibration | after calibration | change |" in text
    for key, label in (("step_time_s", "step time (s)"), ("tokens_per_s", "tokens/s")):
        before, after = replanned["before"][key], replanned["after"][key]
        assert f"| {label} | {format_number(before)} | {format_number(after)} | {after / before - 1:+.1%} |" in text
    (run,) = replanned["measured_runs"]
    assert format_number(run["measured_tokens_per_s"]) in text and format_number(run["after_tokens_per_s"]) in text
    assert "What changed: layout" in text and "GEMM rate 71% of peak" in text
    page = render_html(report)
    assert "<h3>Before and after calibration</h3>" in page and "<th>after calibration</th>" in page
    assert format_number(replanned["after"]["tokens_per_s"]) in page


def test_a_calibration_that_does_not_apply_says_why(report):
    text = render_markdown(report)  # the fixture's run measured a CPU for an 8xH100 plan
    assert "### Before and after calibration" in text
    assert "Not calibrated: measured on CPU" in text and "| figure |" not in text
    assert "Not calibrated: measured on CPU" in render_html(report)
