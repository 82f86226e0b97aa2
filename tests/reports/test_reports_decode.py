"""Decode rows of the throughput stage: the targets' verdicts, their tables in Markdown and HTML, and ``adapt gate``."""

from __future__ import annotations

import json
import random

import pytest

from adapt.app.cli import main
from adapt.core.verdicts import DECODE_TARGETS, decode_targets
from reports.html import render_html
from reports.markdown import render_markdown
from reports.schema import stage, summary
from reports.tables import decode_table, format_number


def rows(rates: dict[tuple[str, int], float], idle: float | None = 0.05) -> list[dict]:
    """Decode timings as the validator writes them (tokens dropped), one per (variant, batch)."""
    return [
        {"variant": v, "batch": b, "decode_tokens_per_s": r, "prompt_len": 512, "new_tokens": 256,
         "decode_spread": 1.01, "gpu_idle_share": idle if v == "adapted" else None}
        for (v, b), r in rates.items()
    ]  # fmt: skip


def meeting_targets(rng: random.Random) -> dict[tuple[str, int], float]:
    """Fresh rates where adapted beats static+compile and triples eager at batch 1 and 8."""
    out = {}
    for batch in (1, 8):
        static = rng.uniform(100, 2000) * batch
        out |= {("hf-static-compile", batch): static, ("adapted", batch): static * rng.uniform(1.01, 1.5)}
        out[("hf-eager", batch)] = out[("adapted", batch)] / rng.uniform(3.1, 10)
    return out


def with_decode(report: dict, timings: list[dict], device: str = "cuda") -> dict:
    """The fixture's throughput stage as a CUDA run that timed these decode rows, status as its judge would give."""
    entry = stage(report, "throughput")
    targets = decode_targets(timings, device.startswith("cuda"))
    entry["summary"].update(device=device, decode=timings, decode_targets=targets)
    entry["status"] = "failed" if any(t["verdict"] == "failed" for t in targets) else "passed"
    report["status"] = "failed" if entry["status"] == "failed" else report["status"]
    return report


def test_targets_judge_each_batch_against_both_paths(rng):
    rates = meeting_targets(rng)
    targets = decode_targets(rows(rates), on_gpu=True)
    assert [t["batch"] for t in targets] == [1, 8] and all(t["verdict"] == "passed" for t in targets)
    for t in targets:
        b = t["batch"]
        assert t["vs_static_compile"] == pytest.approx(rates[("adapted", b)] / rates[("hf-static-compile", b)])
        assert t["vs_eager"] == pytest.approx(rates[("adapted", b)] / rates[("hf-eager", b)])
        assert (t["min_vs_static_compile"], t["min_vs_eager"]) == (1.0, 3.0)
        assert t["adapted_tokens_per_s"] == rates[("adapted", b)]
    rates[("hf-eager", 8)] = rates[("adapted", 8)] / 2.5  # only 2.5x eager at batch 8
    targets = decode_targets(rows(rates), on_gpu=True)
    assert [t["verdict"] for t in targets] == ["passed", "failed"]
    assert targets[1]["eager_verdict"] == "failed" and targets[1]["static_compile_verdict"] == "passed"
    assert "x2.50 of hf-eager (min x3): failed" in targets[1]["reason"]


def test_targets_are_inconclusive_when_unmeasured_or_on_a_cpu_and_host_bound_is_said_not_excused(rng):
    rates = meeting_targets(rng)
    host_bound = decode_targets(rows(rates, idle=0.45), on_gpu=True)
    assert {t["verdict"] for t in host_bound} == {"passed"} and all(t["host_bound"] for t in host_bound)
    assert "idle 45%" in host_bound[0]["reason"]
    rates[("adapted", 1)] = rates[("hf-static-compile", 1)] * 0.8
    slower = decode_targets(rows(rates, idle=0.45), on_gpu=True)
    assert slower[0]["verdict"] == "failed" and slower[0]["host_bound"]  # host-bound does not excuse a slower path
    assert not any(t["host_bound"] for t in decode_targets(rows(rates, idle=0.1), on_gpu=True))
    del rates[("hf-static-compile", 8)]
    missing = decode_targets(rows(rates), on_gpu=True)
    assert missing[1]["static_compile_verdict"] == "inconclusive" and missing[1]["vs_static_compile"] is None
    assert missing[1]["eager_verdict"] == "passed" and missing[1]["verdict"] == "inconclusive"
    assert "hf-static-compile not measured" in missing[1]["reason"]
    assert {t["verdict"] for t in decode_targets(rows(rates), on_gpu=False)} == {"inconclusive"}


def test_markdown_and_html_show_every_batch_with_rates_ratios_and_verdicts(report, rng):
    rates = meeting_targets(rng)
    rates[("adapted", 1)] = rates[("hf-static-compile", 1)] * 0.9  # batch 1 misses the static target
    rates[("hf-eager", 1)] = rates[("adapted", 1)] / 5  # and still meets the eager one
    report = with_decode(report, rows(rates))
    table = decode_table(report)
    assert list(table["batch"]) == [1, 8]
    assert list(table["verdict"]) == ["failed", "passed"]
    assert table["vs static+compile target"][0] == "failed (min 1x)"
    assert table["adapted / static+compile"][0] == pytest.approx(0.9)
    markdown = render_markdown(report)
    decode = markdown.split("### Decode", 1)[1]
    assert "prompt 512, 256 new tokens" in decode
    line = next(x for x in decode.splitlines() if x.startswith("| 1 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    expected = [rates[(v, 1)] for v in ("hf-eager", "hf-static-compile", "adapted")]
    assert cells[1:4] == [format_number(r) for r in expected] and cells[4] == "0.9"
    assert cells[6:] == ["failed (min 1x)", "passed (min 3x)", "failed"]
    assert "decode at batch 1: x0.90 of hf-static-compile (min x1): failed" in decode
    page = render_html(report)
    assert "<h3>Decode</h3>" in page and "failed (min 1x)" in page and "passed (min 3x)" in page


def test_no_decode_rows_no_decode_section(report):
    assert decode_table(report).empty and "### Decode" not in render_markdown(report)


def _gate(tmp_path, report: dict, thresholds: str | None = None) -> tuple[int, dict]:
    (tmp_path / "report.json").write_text(json.dumps(report))
    args = ["gate", str(tmp_path / "report.json"), "--json"]
    if thresholds is not None:
        (tmp_path / "t.yaml").write_text(thresholds)
        args += ["--thresholds", str(tmp_path / "t.yaml")]
    try:
        code = main(args)
    except SystemExit as exit_:
        code = int(exit_.code)
    return code


def test_gate_lists_the_decode_targets_and_rejudges_them(tmp_path, report, capsys, rng):
    rates = meeting_targets(rng)
    report = with_decode(report, rows(rates))
    assert _gate(tmp_path, report) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"] if c["stage"] == "throughput"}
    names = {f"decode batch {b} vs {n}" for b in (1, 8) for n in DECODE_TARGETS}
    assert names <= set(checks) and all(checks[n]["passed"] for n in names)
    assert "ratio" in checks["decode batch 8 vs hf-eager"]["detail"]
    ratio = min(rates[("adapted", b)] / rates[("hf-eager", b)] for b in (1, 8))
    assert _gate(tmp_path, report, f"throughput: {{min_decode_vs_eager: {ratio + 0.5}}}") == 1  # stricter fails
    failed = [c["name"] for c in json.loads(capsys.readouterr().out)["checks"] if not c["passed"]]
    assert failed and all(name.endswith("vs hf-eager") for name in failed)

    rates[("adapted", 8)] = rates[("hf-eager", 8)] * 2.0  # misses both targets at batch 8
    report = with_decode(report, rows(rates))
    assert _gate(tmp_path, report) == 1
    capsys.readouterr()
    loose = "throughput: {min_decode_vs_eager: 1.5, min_decode_vs_static_compile: 0.0}"
    assert _gate(tmp_path, report, loose) == 0
    capsys.readouterr()


def test_gate_judges_decode_rows_of_a_report_that_predates_the_targets(tmp_path, report, capsys, rng):
    rates = meeting_targets(rng)
    rates[("adapted", 1)] = rates[("hf-static-compile", 1)] * 0.8
    report = with_decode(report, rows(rates))
    del summary(report, "throughput")["decode_targets"]
    assert _gate(tmp_path, report) == 1
    failed = [c["name"] for c in json.loads(capsys.readouterr().out)["checks"] if not c["passed"]]
    assert "decode batch 1 vs hf-static-compile" in failed
