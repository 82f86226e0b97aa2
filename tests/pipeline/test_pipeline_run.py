"""``adapt run`` end to end on the bundled example: verdicts, reuse, invalidation, exit codes."""

from __future__ import annotations

import importlib
import json
import sys
import xml.etree.ElementTree as ET

import pytest
from pipeline_broken_kernel import BROKEN_MODULE, broken_apply_kernel_plan
from pipeline_helpers import EXAMPLE, adapt_run, cli, load, statuses

from adapt.app.pipeline.options import STAGE_NAMES
from adapt.app.pipeline.store import source_fingerprint
from reports import load_report


def test_full_run_passes_every_stage_and_writes_every_report(example_run):
    code, out, _ = example_run
    report = load_report(out)
    assert statuses(report) == {name: "passed" for name in STAGE_NAMES}, [
        (s["name"], s["verdict"]) for s in report["stages"] if s["status"] != "passed"
    ]
    assert code == 0 and report["exit_code"] == 0 and report["status"] == "passed"
    for name in ("report.md", "report.html", "junit.xml"):
        assert (out / name).stat().st_size > 0
    for name in STAGE_NAMES:
        assert json.loads((out / "stages" / f"{name}.json").read_text())["status"] == "passed"
    assert not list(out.rglob("*.tmp")), "atomic writes left temporary files behind"


def test_throughput_writes_the_calibration_and_the_replan_reads_it(example_run):
    from parallel_planner.calibration import load_calibration

    _, out, _ = example_run
    cal = load_calibration(out / "artifacts" / "throughput" / "calibration.json")
    throughput = next(s for s in load(out)["stages"] if s["name"] == "throughput")
    adapted = next(v for v in throughput["result"]["variants"] if v["name"] == "adapted")
    assert cal.runs[0]["tokens_per_s"] == adapted["train_tokens_per_s"] and cal.device.startswith("CPU")
    replan = next(s for s in load(out)["stages"] if s["name"] == "replan")
    # a CPU measurement says nothing about the GPU cluster the plan targets: the plan stands, saying why
    assert replan["status"] == "passed" and not replan["result"]["applied"] and replan["result"]["after"] is None
    assert replan["result"]["device"] == cal.device and "CPU" in replan["summary"]["reason"]


def test_second_run_reuses_every_stage(example_run):
    _, out, first_seconds = example_run
    before = load(out)
    assert adapt_run(EXAMPLE, out) == 0
    after = load(out)
    assert all(s["cached"] for s in after["stages"])
    # the reused stage records are the stored ones, byte for byte in their results
    assert [s["result"] for s in after["stages"]] == [s["result"] for s in before["stages"]]


def test_force_and_source_change_recompute(example_copy, tmp_path):
    out = tmp_path / "run"
    assert adapt_run(example_copy, out, "--stages", "intake") == 0
    assert adapt_run(example_copy, out, "--stages", "intake") == 0
    assert load(out)["stages"][0]["cached"] is True
    assert adapt_run(example_copy, out, "--stages", "intake", "--force") == 0
    assert load(out)["stages"][0]["cached"] is False

    fingerprint = source_fingerprint(example_copy)
    config = json.loads((example_copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5  # a real change to the model
    (example_copy / "config.json").write_text(json.dumps(config))
    assert source_fingerprint(example_copy) != fingerprint
    assert adapt_run(example_copy, out, "--stages", "intake") == 0
    report = load(out)
    assert report["stages"][0]["cached"] is False
    assert report["source"]["fingerprint"] == source_fingerprint(example_copy)


def test_skip_and_stages_select(tmp_path):
    out = tmp_path / "run"
    assert adapt_run(EXAMPLE, out, "--stages", "intake,plan") == 0
    got = statuses(load(out))
    assert got["intake"] == got["plan"] == "passed"
    assert {got[n] for n in STAGE_NAMES if n not in ("intake", "plan")} == {"skipped"}
    # a selection whose stage lacks its input cannot run: bad input, and the earlier report is untouched
    before = (out / "report.json").read_text()
    assert adapt_run(EXAMPLE, out, "--stages", "alignment") == 2
    assert (out / "report.json").read_text() == before


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "/nonexistent/model-dir"],
        ["run", str(EXAMPLE), "--stages", "intake,typo"],
        ["run", str(EXAMPLE), "--seq-len", "0"],
        ["run", str(EXAMPLE), "--dtype", "fp64"],
        ["run", str(EXAMPLE), "--stages", "intake", "--skip", "intake"],
        ["run", str(EXAMPLE), "--trust-remote-code", "--allow-pickle", "--batch-size", "-1"],
    ],
)
def test_bad_input_exits_2(argv, tmp_path, capsys):
    assert cli(*argv, "--out", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert "adapt: error:" in err and "Traceback" not in err


@pytest.mark.parametrize("cluster", ["banana", "8xNOT_A_GPU", "0xH100", "2x"])
def test_bad_cluster_is_rejected_before_any_stage(cluster, tmp_path, capsys):
    out = tmp_path / "run"
    assert adapt_run(EXAMPLE, out, "--cluster", cluster) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cluster" in err[0] and cluster in err[0] and "allowed" in err[0]
    assert not (out / "stages").exists()


def test_unimportable_stage_fails_that_stage_only(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "parallel_planner"] + ["parallel_planner"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if the package were not installed
    out = tmp_path / "run"
    assert adapt_run(EXAMPLE, out, "--stages", "intake,plan") == 1
    report = load(out)
    plan = next(s for s in report["stages"] if s["name"] == "plan")
    assert plan["status"] == "error" and "not importable" in plan["error"]
    assert plan["result"] is None  # nothing invented
    assert statuses(report)["intake"] == "passed"


def test_interrupt_leaves_valid_partial_report(tmp_path, monkeypatch):
    align_module = importlib.import_module("validators.align")  # the module, not the package's same-named function

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(align_module, "align", interrupted)
    out = tmp_path / "run"
    assert adapt_run(EXAMPLE, out, "--stages", "intake,operators,alignment,soak") == 130
    report = load_report(out)  # parses and validates
    got = statuses(report)
    assert (got["intake"], got["operators"], got["alignment"], got["soak"]) == (
        "passed",
        "passed",
        "interrupted",
        "pending",
    )
    assert report["status"] == "interrupted"
    assert (out / "report.html").exists() and (out / "junit.xml").exists()
    # the finished stages are kept and reused by the next run
    monkeypatch.undo()
    assert adapt_run(EXAMPLE, out, "--stages", "intake,operators") == 0
    assert all(s["cached"] for s in load(out)["stages"] if s["status"] == "passed")


def test_broken_kernel_fails_and_junit_names_the_block(tmp_path, monkeypatch):
    """A kernel plan whose norm in block 1 is off by 1%: exit 1, and JUnit names block 1 first."""
    import operators

    monkeypatch.setattr(operators, "apply_kernel_plan", broken_apply_kernel_plan(operators.apply_kernel_plan))
    out = tmp_path / "run"
    assert adapt_run(EXAMPLE, out, "--stages", "intake,operators,alignment") == 1
    align = next(s for s in load(out)["stages"] if s["name"] == "alignment")
    assert align["status"] == "failed"
    assert align["summary"]["first_divergent"] == BROKEN_MODULE

    suites = ET.parse(out / "junit.xml").getroot()
    failing = [
        (case.get("classname"), case.get("name"), case.find("failure").get("message"))
        for case in suites.iter("testcase")
        if case.find("failure") is not None
    ]
    assert failing[0][:2] == ("adapt.stages", "alignment")
    blocks = [(cls, name, msg) for cls, name, msg in failing if cls.startswith("adapt.alignment")]
    assert blocks[0][:2] == ("adapt.alignment.block1", BROKEN_MODULE)
    assert blocks[0][2].startswith("first divergent;")
    assert not any(cls == "adapt.alignment.block0" for cls, _, _ in blocks)
