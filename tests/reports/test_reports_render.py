"""Rendering report.json (from real runs) into Markdown, self-contained HTML with plots, and JUnit."""

from __future__ import annotations

import base64
import io
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import matplotlib.image
import pytest

from adapt.app.pipeline.options import STAGE_NAMES
from reports import validate_report
from reports.html import render_html
from reports.junit import render_junit
from reports.markdown import render_markdown
from reports.schema import summary


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images: list[dict[str, str]] = []
        self.external: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "img":
            self.images.append(attrs)
        for key in ("src", "href"):
            if key in attrs and not attrs[key].startswith(("data:", "#")):
                self.external.append(attrs[key])
        if tag in ("script", "link"):
            self.external.append(tag)


def test_fixture_is_a_current_report(report):
    validate_report(report)
    assert [s["name"] for s in report["stages"]] == list(STAGE_NAMES)


def test_markdown_has_every_section_and_table(report):
    text = render_markdown(report)
    for heading in ("## Summary", "## What is new in this model", "## Operator mapping", "## Parallel plan",
                    "## Alignment", "## Throughput", "## Soak"):  # fmt: skip
        assert heading in text
    for layer in summary(report, "alignment")["layers"]:
        assert f"| {layer['name']} |" in text
    for comp in summary(report, "operators")["components"]:
        assert f"| {comp['module']} |" in text
    assert "| metric | unit | baseline | adapted |" in text.replace(" | compiled", "")
    assert "Memory per GPU of the chosen plan" in text


def test_html_is_self_contained_and_every_plot_decodes(report):
    page = _Page()
    page.feed(render_html(report))
    assert page.external == []
    plots = {img["data-plot"]: img["src"] for img in page.images}
    assert set(plots) == {"alignment", "operators", "plan", "throughput", "soak"}
    for name, src in plots.items():
        assert src.startswith("data:image/png;base64,"), name
        pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), format="png")
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100, name
        assert pixels.std() > 0.01, f"{name} plot is blank"


def test_junit_has_a_case_per_stage_layer_and_component(report):
    root = ET.fromstring(render_junit(report))
    cases = list(root.iter("testcase"))
    layers = summary(report, "alignment")["layers"]
    comps = summary(report, "operators")["components"]
    assert len(cases) == len(STAGE_NAMES) + len(layers) + len(comps)
    assert int(root.get("tests")) == len(cases)
    assert int(root.get("failures")) == 0 and int(root.get("errors")) == 0


def test_junit_names_the_failing_block(report):
    align = next(s for s in report["stages"] if s["name"] == "alignment")
    block_layers = [layer for layer in align["summary"]["layers"] if layer["block"] == 1]
    for layer in block_layers:
        layer["passed"] = False
    align["status"] = "failed"
    align["summary"]["first_divergent"] = block_layers[0]["name"]
    root = ET.fromstring(render_junit(report))
    failed = [(c.get("classname"), c.get("name"), c.find("failure").get("message")) for c in root.iter("testcase")
              if c.find("failure") is not None]  # fmt: skip
    assert ("adapt.stages", "alignment") == failed[0][:2]
    assert {cls for cls, _, _ in failed[1:]} == {"adapt.alignment.block1"}
    assert failed[1][2].startswith("first divergent;") and block_layers[0]["name"] in failed[1][2]


@pytest.mark.parametrize("cut", ["operators", "alignment", "soak"])
def test_partial_report_renders(report, cut):
    """A run interrupted at ``cut``: later stages pending, every format still renders."""
    later = False
    for entry in report["stages"]:
        later = later or entry["name"] == cut
        if later:
            entry.update(
                status="interrupted" if entry["name"] == cut else "pending", summary={}, result=None, verdict=""
            )
    report["status"] = "interrupted"
    assert "No result: stage" in render_markdown(report)
    page = _Page()
    page.feed(render_html(report))
    assert "soak" not in {img["data-plot"] for img in page.images}
    root = ET.fromstring(render_junit(report))
    pending = len(STAGE_NAMES) - 1 - list(STAGE_NAMES).index(cut)
    assert int(root.get("errors")) == 1 and int(root.get("skipped")) == pending
