"""The pytest plugin: ``pytest --adapt-model SOURCE`` turns each aligned block/component into a test item."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

from pipeline_broken_kernel import BROKEN_MODULE, CONFTEST
from pipeline_helpers import EXAMPLE


def _pytest(cwd, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", "--rootdir", str(cwd), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_plugin_is_registered_as_pytest11_entry_point():
    assert "adapt.app.pytest_plugin" in {ep.value for ep in entry_points(group="pytest11")}


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
