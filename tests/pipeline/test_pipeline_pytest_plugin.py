"""The pytest plugin: ``pytest --adapt-model SOURCE`` turns each aligned block/component into a test item."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

from broken_kernel import BROKEN_MODULE, CONFTEST
from pipeline_helpers import EXAMPLE


def _pytest(cwd, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", "--rootdir", str(cwd), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_plugin_is_registered_as_pytest11_entry_point():
    assert "validators.pytest_plugin" in {ep.value for ep in entry_points(group="pytest11")}


def test_one_item_per_block_and_component(tmp_path):
    out = tmp_path / "run"
    proc = _pytest(tmp_path, "--adapt-model", str(EXAMPLE), "--adapt-out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    align = next(s for s in json.loads((out / "report.json").read_text())["stages"] if s["name"] == "alignment")
    expected = 3 + len(align["summary"]["layers"]) + len(align["summary"]["gradients"])
    assert f"{expected} passed" in proc.stdout
    assert any(layer["name"] == BROKEN_MODULE for layer in align["summary"]["layers"])


def test_broken_kernel_fails_exactly_its_items(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    proc = _pytest(tmp_path, "--adapt-model", str(EXAMPLE))
    assert proc.returncode == 1
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    assert any(f"align[{BROKEN_MODULE}]" in line for line in failed), proc.stdout[-3000:]
    assert any("stage[alignment]" in line for line in failed)
    assert not any("align[model.layers.0" in line for line in failed)
