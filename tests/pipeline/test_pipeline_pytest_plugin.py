"""The pytest plugin: ``pytest --adapt-model SOURCE`` turns each aligned block/component into a test item."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from typing import Any

from pipeline_broken_kernel import BROKEN_MODULE, CONFTEST
from pipeline_helpers import EXAMPLE, leaf_commands

from adapt.app import pytest_plugin
from adapt.app.options import default_of, groups, option_fields
from adapt.app.pipeline.options import RunOptions


def _pytest(cwd, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", "--rootdir", str(cwd), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_plugin_is_registered_as_pytest11_entry_point():
    assert "adapt.app.pytest_plugin" in {ep.value for ep in entry_points(group="pytest11")}


class _RecordingParser:
    """Stands in for pytest's parser: keeps what the plugin adds, by option name."""

    def __init__(self) -> None:
        self.added: dict[str, dict[str, Any]] = {}

    def getgroup(self, *_: str) -> _RecordingParser:
        return self

    def addoption(self, *names: str, **attrs: Any) -> None:
        assert len(names) == 1 and names[0] not in self.added
        self.added[names[0]] = attrs


def test_every_plugin_option_is_an_options_tree_field_with_its_adapt_run_flag_and_default():
    parser = _RecordingParser()
    pytest_plugin.pytest_addoption(parser)
    tree = {field.name: (group, field) for group, cls in groups(RunOptions) for field in option_fields(cls)}
    run = leaf_commands()["run"]
    shown = {action.dest: action for action in run._actions if action.help is not argparse.SUPPRESS}
    assert {"--adapt-model", "--adapt-out", "--adapt-dtype", "--adapt-thresholds"} <= set(parser.added)
    for name, attrs in parser.added.items():
        field_name = attrs["dest"].removeprefix("adapt_")
        group, field = tree[field_name]  # every plugin option sets a field of the tree
        action = shown[field_name]
        cli_name = action.option_strings[0].removeprefix("--") if action.option_strings else group
        assert name == f"--adapt-{cli_name}"
        assert attrs["default"] == default_of(field) == action.default
        assert attrs["help"] == action.help
        assert (attrs.get("type"), attrs.get("choices"), attrs.get("action", "store")) == (
            action.type,
            action.choices,
            "store_true" if isinstance(action, argparse._StoreTrueAction) else "store",
        )


def test_one_item_per_tensor_and_a_broken_kernel_fails_exactly_its_items(tmp_path):
    """Block 1's norm is 1% off: its items fail, block 0's pass, and every tensor is its own item."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    out = tmp_path / "run"
    proc = _pytest(tmp_path, "--adapt-model", str(EXAMPLE), "--adapt-out", str(out))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    align = next(s for s in json.loads((out / "report.json").read_text())["stages"] if s["name"] == "alignment")
    tensors = align["summary"]["layers"] + align["summary"]["gradients"]
    failing = {f"align[{t['name']}]" for t in align["summary"]["layers"] if not t["passed"]}
    failing |= {f"grad[{t['name']}]" for t in align["summary"]["gradients"] if not t["passed"]}
    failing.add("stage[alignment]")
    summary_line = proc.stdout.strip().splitlines()[-1]
    assert f"{len(failing)} failed, {3 + len(tensors) - len(failing)} passed" in summary_line

    failed_lines = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    assert {line.split(" - ")[0].split("::")[-1] for line in failed_lines} == failing
    assert f"align[{BROKEN_MODULE}]" in failing
    assert not any(name.startswith("align[model.layers.0") for name in failing)
