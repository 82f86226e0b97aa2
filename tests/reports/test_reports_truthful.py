"""Reports say what happened and no more: read from the rendered Markdown and HTML of real runs."""

from __future__ import annotations

import html as html_lib
import json
import re
import shlex
import sys
from itertools import combinations

import pytest

from adapt.app.cli import main
from reports.html import render_html
from reports.markdown import render_markdown
from reports.plots import throughput_figure
from reports.schema import stage, summary


def _text(page: str) -> str:
    """The HTML page's visible text, tags removed (alt text and figures aside)."""
    return html_lib.unescape(re.sub(r"<[^>]+>", " ", re.sub(r'src="data:[^"]*"', "", page)))


def _section(markdown: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", markdown, re.DOTALL | re.MULTILINE)
    assert match, f"no section {title!r}"
    return match.group(1)


def _fail_stage(report: dict, name: str, error: str) -> None:
    entry = stage(report, name)
    entry.update(status="error", error=error, error_kind="RuntimeError", verdict=error, summary={}, result=None)
    report["status"], report["exit_code"] = "error", 1


def test_errors_and_notes_appear_in_html_as_in_markdown(report):
    _fail_stage(report, "soak", "RuntimeError: checkpoint save at step 4 failed: disk full")
    stage(report, "plan")["summary"]["notes"] = ["plan sequence length capped at 256"]
    markdown, page = render_markdown(report), _text(render_html(report))
    problems = _section(markdown, "Errors and notes")
    assert "soak error: RuntimeError: checkpoint save at step 4 failed: disk full" in problems
    assert "Errors and notes" in page
    assert "soak error: RuntimeError: checkpoint save at step 4 failed: disk full" in page
    assert "plan: plan sequence length capped at 256" in problems and "plan: plan sequence length capped at 256" in page


def test_what_is_new_lists_only_what_no_known_kind_covers(report):
    assert summary(report, "intake")["novelties"] == ["GQA attention in 2/2 blocks"]  # a plain Llama
    new = _section(render_markdown(report), "What is new in this model")
    assert "Nothing: every component matches a kind adapt knows." in new
    assert "GQA attention" not in new.split("Architecture features")[0]  # a known feature, not news
    assert "Architecture features (kinds adapt knows): GQA attention in 2/2 blocks." in new
    stage(report, "operators")["summary"]["new"] = ["model.layers.0.mlp.quench: no kernel kind"]
    for rendered in (_section(render_markdown(report), "What is new in this model"), _text(render_html(report))):
        assert "model.layers.0.mlp.quench: no kernel kind" in rendered and "Nothing:" not in rendered


@pytest.mark.parametrize("status", ["error", "interrupted", "pending", "skipped"])
def test_what_is_new_says_not_examined_when_operators_did_not_run(report, status):
    entry = stage(report, "operators")
    entry.update(status=status, summary={}, result=None)
    for rendered in (_section(render_markdown(report), "What is new in this model"), _text(render_html(report))):
        assert f"not examined: the operators stage {status}" in rendered
        assert "Nothing:" not in rendered


def test_cpu_throughput_carries_its_caveat_and_says_the_spread_is_unknown(report):
    assert summary(report, "throughput")["device"] == "cpu"
    for rendered in (_section(render_markdown(report), "Throughput"), _text(render_html(report))):
        assert "below the noise floor" in rendered and "Measure speed-ups on the target GPU" in rendered
        assert "spread over repeats is unknown" in rendered
    summary(report, "throughput")["rows"][0]["spread"] = 1.4
    assert "Spread over repeats (max/min): train step 1.40x." in _section(render_markdown(report), "Throughput")


def test_cuda_throughput_has_no_cpu_caveat(report):
    summary(report, "throughput")["device"] = "cuda"
    assert "noise floor" not in _section(render_markdown(report), "Throughput")


def test_launch_command_points_at_the_written_plan_and_no_local_interpreter(report):
    report["options"]["out_dir"] = "runs/tiny"
    best = summary(report, "plan")["best"]
    best["command"] = shlex.join([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "-m", "adapt",
                                  "train", "src", "--plan", "plan.json"])  # fmt: skip
    markdown, page = render_markdown(report), _text(render_html(report))
    for rendered in (markdown, page):
        assert (
            "python -m torch.distributed.run --nproc-per-node 8 -m adapt train src --plan runs/tiny/plan.json"
            in rendered
        )
        assert sys.executable not in rendered


def test_cached_stages_keep_their_measured_durations(report):
    for entry in report["stages"]:
        entry["cached"] = True
    markdown, page = render_markdown(report), _text(render_html(report))
    operators = stage(report, "operators")["duration_s"]
    assert f"| operators | passed | {operators:.1f}s (cached) |" in markdown
    assert f"{operators:.1f}s (cached)" in page


def test_every_rotary_row_names_its_provider_and_kernel(report):
    components = summary(report, "operators")["components"]
    components.append({"module": "model.layers.0.self_attn", "kind": "rotary_application", "provider": None,
                       "kernel": None, "status": "native"})  # as the operators stage records it  # fmt: skip
    ops = _section(render_markdown(report), "Operator mapping")
    rows = [line for line in ops.splitlines() if "| rotary" in line]
    assert len(rows) >= 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] and cells[3], row  # provider and kernel
    assert "| model.layers.0.self_attn | rotary_application | torch-native | aten ops as traced | native |" in ops


def test_every_share_figure_says_what_it_is_a_share_of(report):
    ops = _section(render_markdown(report), "Operator mapping")
    assert "share of components" in ops
    assert "share of traced ops: fused" in ops and "share of FLOPs on fused or native paths" in ops
    assert not re.search(r"^\| share_by_status|^\| flops_share", ops, re.MULTILINE)  # no bare keys


def test_throughput_figure_labels_do_not_overlap(report):
    fig = throughput_figure(report)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [fig._suptitle]
    for ax in fig.axes:
        texts += [ax.title, ax.yaxis.label, *ax.get_xticklabels()]
    boxes = [t.get_window_extent(renderer) for t in texts if t is not None and t.get_text()]
    overlapping = [(a, b) for a, b in combinations(boxes, 2) if a.overlaps(b)]
    assert not overlapping


def _gate(tmp_path, report, thresholds: str) -> int:
    (tmp_path / "report.json").write_text(json.dumps(report))
    (tmp_path / "t.yaml").write_text(thresholds)
    try:
        return main(["gate", str(tmp_path / "report.json"), "--thresholds", str(tmp_path / "t.yaml")])
    except SystemExit as exit_:
        return int(exit_.code)


def test_gate_min_speedup_judges_only_rows_with_a_speedup(tmp_path, report, capsys):
    rows = summary(report, "throughput")["rows"]
    for row in rows:
        if "speedup" in row:
            row["speedup"] = 1.05
    assert any("speedup" not in row for row in rows)  # step time and peak memory have none
    assert _gate(tmp_path, report, "throughput: {min_speedup: 1.0}") == 0
    rows[0]["speedup"] = 0.5
    assert _gate(tmp_path, report, "throughput: {min_speedup: 1.0}") == 1
    rows[0].pop("speedup")  # a rate that was not measured for both variants fails, it is not skipped
    assert _gate(tmp_path, report, "throughput: {min_speedup: 1.0}") == 1
    capsys.readouterr()


def test_intake_and_operators_disagreements_are_table_rows_and_open_facts_are_named(report):
    from reports.agreement import agreement_table

    assert "agreement" not in summary(report, "operators") and agreement_table(report).empty  # an older run
    row = {"module": "model.layers.1.self_attn", "field": "mixer", "intake": "unknown", "operators": "full_attention"}
    open_fact = {"field": "head.tied", "side": "operators", "reason": "this side does not state it", "modules": ["x"]}
    stage(report, "operators")["summary"]["agreement"] = {
        "compared": {"mixer": 2},
        "total": 2,
        "disagreements": [row],
        "not_examined": [open_fact],
    }
    assert agreement_table(report).to_dict("records") == [
        {"module": row["module"], "fact": "mixer", "intake": "unknown", "operators": "full_attention"}
    ]
    markdown = _section(render_markdown(report), "Operator mapping")
    assert "| model.layers.1.self_attn | mixer | unknown | full_attention |" in markdown
    page = _text(render_html(report))
    for rendered in (markdown, page):
        assert "model.layers.1.self_attn" in rendered and "head.tied" in rendered
