"""``adapt gate`` (re-judging with other thresholds), ``adapt report matrix`` and ``adapt report render``."""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from adapt.app.cli import main
from reports.schema import summary


def _cli(*argv: str) -> int:
    try:
        return main(list(argv))
    except SystemExit as exit_:
        return int(exit_.code)


def _write(tmp_path: Path, report: dict, name: str = "run") -> Path:
    run = tmp_path / name
    run.mkdir()
    (run / "report.json").write_text(json.dumps(report))
    return run


def test_gate_passes_a_passing_report(tmp_path, report):
    assert _cli("gate", str(_write(tmp_path, report) / "report.json")) == 0


def test_gate_stricter_thresholds_fail_and_name_the_first_layer(tmp_path, report, capsys):
    layers = summary(report, "alignment")["layers"]
    worst = max(layers, key=lambda layer: layer["rel_err"])
    strict = tmp_path / "strict.yaml"
    # Stricter: half the worst error, and no waiver for tensors the unadapted model gets as wrong.
    strict.write_text(f"alignment:\n  max_rel_err: {worst['rel_err'] / 2!r}\n  allow_dtype_cost: false\n")
    run = _write(tmp_path, report)
    junit = tmp_path / "gate.xml"
    assert _cli("gate", str(run), "--thresholds", str(strict), "--junit", str(junit)) == 1
    out = capsys.readouterr().out
    first_bad = next(layer["name"] for layer in layers if layer["rel_err"] > worst["rel_err"] / 2)
    assert f"first divergent: {first_bad}" in out
    failures = [c.get("name") for c in ET.parse(junit).getroot().iter("testcase") if c.find("failure") is not None]
    assert first_bad in failures and worst["name"] in failures


def test_gate_looser_thresholds_pass_a_failed_alignment(tmp_path, report):
    align = next(s for s in report["stages"] if s["name"] == "alignment")
    align["status"] = "failed"
    layer = align["summary"]["layers"][0]
    layer["passed"] = False
    layer["rel_err"] = 0.5 * align["summary"]["thresholds"]["max_rel_err"] + layer["rel_err"]
    run = _write(tmp_path, report)
    assert _cli("gate", str(run)) == 1  # the report's own verdict
    loose = tmp_path / "loose.json"
    limits = {"max_rel_err": 1.0, "max_err_ratio": 1e9, "min_cosine": 0.0, "rel_err_floor": 1.0}
    loose.write_text(json.dumps({"alignment": limits}))
    assert _cli("gate", str(run), "--thresholds", str(loose)) == 0


def test_gate_nonfinite_fails_whatever_the_thresholds(tmp_path, report):
    align = next(s for s in report["stages"] if s["name"] == "alignment")
    align["summary"]["layers"][1].update(rel_err="inf", cosine=None, max_abs="inf")
    loose = tmp_path / "loose.yaml"
    loose.write_text("alignment: {max_rel_err: 1.0e9, max_err_ratio: 1.0e9, min_cosine: -1.0, rel_err_floor: 1.0e9}\n")
    assert _cli("gate", str(_write(tmp_path, report)), "--thresholds", str(loose)) == 1


def test_gate_operators_and_soak_thresholds(tmp_path, report):
    run = _write(tmp_path, report)
    strict = tmp_path / "ops.yaml"
    strict.write_text("operators: {min_fast_flop_share: 1.01}\nsoak: {max_step_time_cv: 0.0}\n")
    assert _cli("gate", str(run), "--thresholds", str(strict), "--json") == 1
    ignore = tmp_path / "ignore.yaml"
    ignore.write_text("operators: {min_fast_flop_share: 1.01}\nignore: [operators]\n")
    assert _cli("gate", str(run), "--thresholds", str(ignore)) == 0


@pytest.mark.parametrize(
    "content",
    [
        "alignment: {max_rel_eror: 0.1}\n",
        "speed: {min: 1}\n",
        "alignment: {max_rel_err: lots}\n",
        "[1, 2\n",
        "alignment: {max_rel_err: .nan}\n",
    ],
)
def test_gate_bad_thresholds_exit_2(tmp_path, report, content):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content)
    assert _cli("gate", str(_write(tmp_path, report)), "--thresholds", str(bad)) == 2


def test_gate_bad_report_exit_2(tmp_path, report):
    (tmp_path / "x.json").write_text("{not json")
    assert _cli("gate", str(tmp_path / "x.json")) == 2
    assert _cli("gate", str(tmp_path / "missing.json")) == 2
    report["schema_version"] = 999
    assert _cli("gate", str(_write(tmp_path, report))) == 2


@pytest.mark.parametrize(
    "damage",
    [
        lambda stages: stages[0].update(status="weird"),
        lambda stages: stages[0].update(name=3),
        lambda stages: stages[1].update(summary=[1, 2]),
        lambda stages: stages[1].update(result="text"),
    ],
    ids=["unknown-status", "name-not-text", "summary-list", "result-text"],
)
def test_a_damaged_stage_entry_is_bad_input_not_a_verdict(tmp_path, report, damage, capsys):
    """A gate must not pass (or fail) a report it cannot read: exit 2 with one line naming the stage."""
    damaged = copy.deepcopy(report)
    damage(damaged["stages"])
    assert _cli("gate", str(_write(tmp_path, damaged))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stage" in err[0]


def test_matrix_over_three_models(tmp_path, all_reports, capsys):
    runs = [str(_write(tmp_path, rep, name)) for name, rep in all_reports.items()]
    stem = tmp_path / "matrix"
    assert _cli("report", "matrix", *runs, "--out", str(stem)) == 0
    md = (tmp_path / "matrix.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 3
    for rep in all_reports.values():
        assert Path(rep["source"]["text"]).name in md
    header = md.splitlines()[2]
    for column in (
        "intake",
        "operators",
        "plan",
        "environment",
        "alignment",
        "throughput",
        "soak",
        "coverage",
        "speedup",
    ):
        assert f" {column} " in header
    page = (tmp_path / "matrix.html").read_text()
    assert page.count("<tr>") == 1 + 3  # header + one row per model


def test_render_command_rewrites_reports(tmp_path, report):
    run = _write(tmp_path, report)
    assert _cli("report", "render", str(run)) == 0
    assert (run / "report.md").read_text().startswith("# adapt report")
    assert ET.parse(run / "junit.xml").getroot().tag == "testsuites"
