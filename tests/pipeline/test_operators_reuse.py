"""A stored operators result is rebuilt from its JSON, never re-run, while the machine and libraries match."""

from __future__ import annotations

import json

import operators
import operators.timing_cache
from adapt.app.pipeline.options import RunOptions
from adapt.app.pipeline.progress import RunProgress
from adapt.app.pipeline.runner import PipelineRun
from adapt.model.intake import inspect
from operators import OpsReport
from operators.agreement import Agreement, Disagreement


def _run(options: RunOptions) -> PipelineRun:
    run = PipelineRun(options, RunProgress(quiet=True))
    assert run.run().exit_code == 0
    return run


def test_second_run_rebuilds_the_operators_report_from_the_store(example_copy, tmp_path, monkeypatch):
    options = RunOptions.from_dict(
        {"source": str(example_copy), "out_dir": str(tmp_path / "run"), "stages": ["intake", "operators"]}
    )
    first = _run(options)
    live = first.typed["operators"]
    assert not first.records["operators"].cached and set(live.phases) >= {"trace", "recognise", "plan"}

    real_run_ops, calls = operators.run_ops, []

    def counting_run_ops(*args, **kwargs):  # the real stage, counted: the warm path must not reach it
        calls.append(args)
        return real_run_ops(*args, **kwargs)

    monkeypatch.setattr(operators, "run_ops", counting_run_ops)
    second = _run(options)
    assert second.records["operators"].cached
    rebuilt = second.upstream("operators")  # what alignment, generation, bench and soak read
    assert calls == [] and second.rebuilt == []
    assert isinstance(rebuilt, OpsReport) and rebuilt.plan == live.plan
    assert rebuilt.phases == {k: round(v, 3) for k, v in live.phases.items()}  # the first run's, nothing re-timed
    assert rebuilt.recognition == live.recognition and rebuilt.profile == live.profile
    assert rebuilt.patch_check == live.patch_check and rebuilt.new() == live.new()
    # the stage had intake's spec: the comparison is made, and kept
    assert live.agreement is not None and live.agreement.total > 0 and rebuilt.agreement == live.agreement

    # another torch (or triton, transformers, device) is another environment: the stage runs again
    versions = {**operators.timing_cache.library_versions(), "torch": "0.0.0-elsewhere"}
    monkeypatch.setattr(operators.timing_cache, "library_versions", lambda: versions)
    third = _run(options)
    assert not third.records["operators"].cached and len(calls) == 1


def test_report_round_trips_through_json(zoo):
    spec = inspect(str(zoo("qwen3_moe")))
    report = operators.run_ops(str(zoo("qwen3_moe")), onnx=False, check_patch=False, spec=spec)
    data = json.loads(json.dumps(report.to_dict()))
    back = OpsReport.from_dict(data)
    assert back.plan == report.plan and back.recognition == report.recognition and back.target == report.target
    assert back.agreement == report.agreement and report.agreement.total > 0
    assert json.loads(json.dumps(back.to_dict())) == data
    assert back.inventory.tracer == report.inventory.tracer and back.inventory.ops == []


def test_a_disagreement_is_carried_as_information_and_never_fails_the_stage(zoo):
    report = operators.run_ops(str(zoo("llama")), onnx=False, check_patch=False)
    assert report.agreement is None and report.to_dict()["agreement"] is None  # no spec: nothing compared
    passed = report.summary().passed
    report.agreement = Agreement({"mixer": 1}, [Disagreement("mixer", "unknown", "full_attention", "model.layers.0")])
    summary = report.summary()
    assert summary.passed == passed and summary.data["agreement"]["disagreements"][0]["field"] == "mixer"
    assert OpsReport.from_dict(json.loads(json.dumps(report.to_dict()))).agreement == report.agreement
