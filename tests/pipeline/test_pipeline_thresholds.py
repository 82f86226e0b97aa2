"""``adapt run --thresholds`` end to end: a cached re-run with a stricter file re-judges the stored results, and
``adapt gate`` with the same file gives the run's pass/fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipeline_helpers import EXAMPLE, adapt_run, cli, load, statuses

from adapt.core.stage_verdicts import OPERATOR_LIMITS, SOAK_LIMITS

STAGES = ("intake", "operators", "soak")  # the soak has a limit a thresholds file can tighten and runs in seconds
# enough soak steps for a step-time spread past the warm-up (four), no checkpoints: a short soak
SHORT_SOAK = ("--soak-steps", "6", "--ckpt-every", "0")


def _write(path: Path, sections: dict) -> Path:
    path.write_text(json.dumps(sections))
    return path


def _gate(out: Path, thresholds: Path, capsys) -> tuple[int, list[tuple[str, str]]]:
    """``adapt gate``'s exit code and the (stage, check) pairs it failed."""
    capsys.readouterr()
    code = cli("gate", str(out), "--thresholds", str(thresholds), "--json")
    checks = json.loads(capsys.readouterr().out)["checks"]
    return code, [(c["stage"], c["name"]) for c in checks if not c["passed"]]


@pytest.mark.slow  # the first run: operators and a short soak, about 25 s of CPU time
def test_a_stricter_thresholds_file_rejudges_the_cached_run_where_it_bites_and_the_gate_agrees(tmp_path, rng, capsys):
    out = tmp_path / "run"
    stages = ("--stages", ",".join(STAGES), *SHORT_SOAK)
    # the run's own limits, stated explicitly: the defaults the core rules name
    defaults = {
        "operators": {k: v for k, v in OPERATOR_LIMITS.items() if v is not None},
        "soak": {k: v for k, v in SOAK_LIMITS.items() if v is not None},
    }
    first = _write(tmp_path / "defaults.json", defaults)
    assert adapt_run(EXAMPLE, out, *stages, "--thresholds", str(first)) == 0
    report = load(out)
    assert not any(s["cached"] for s in report["stages"] if s["name"] in STAGES)
    assert {statuses(report)[name] for name in STAGES} == {"passed"}
    assert _gate(out, first, capsys) == (0, [])
    soak = next(s for s in report["stages"] if s["name"] == "soak")
    cv = soak["summary"]["step_time_cv"]
    assert cv is not None and cv > 0

    for factor, bites in ((rng.uniform(1.05, 2.0), False), (rng.uniform(0.5, 0.95), True)):
        limits = {**defaults, "soak": {**defaults["soak"], "max_step_time_cv": cv * factor}}
        stricter = _write(tmp_path / f"stricter-{bites}.json", limits)
        code = adapt_run(EXAMPLE, out, *stages, "--thresholds", str(stricter))
        rerun = load(out)
        assert all(s["cached"] for s in rerun["stages"] if s["name"] in STAGES)  # judged again, not run again
        assert [s["result"] for s in rerun["stages"]] == [s["result"] for s in report["stages"]]
        assert code == rerun["exit_code"] == (1 if bites else 0)
        assert statuses(rerun) == {**statuses(report), "soak": "failed" if bites else "passed"}
        assert _gate(out, stricter, capsys) == (code, [("soak", "step_time_cv")] if bites else [])

    assert _gate(out, first, capsys) == (0, [])  # the stored results still pass the run's own limits
