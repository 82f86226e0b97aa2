"""pytest plugin: ``pytest --adapt-model SOURCE [--adapt-dtype bf16]`` makes every aligned block and
component its own test item, so a CI run lists ``model.layers.1.mlp`` as the test that failed.

The plugin runs the pipeline's intake, operators and alignment stages once per session (always
recomputed, never taken from a cache), then collects one item per compared tensor plus one per
stage.  Registered through the ``pytest11`` entry point ``adapt``; without ``--adapt-model`` it
does nothing.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

_STAGES = ["intake", "operators", "alignment"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("adapt", "adapt model alignment")
    group.addoption(
        "--adapt-model", metavar="SOURCE", help="align this model (hub id or directory); one test per block/component"
    )
    group.addoption(
        "--adapt-dtype", choices=("fp32", "bf16", "fp16"), help="candidate dtype (default: chosen by the device)"
    )
    group.addoption("--adapt-device", default="cpu", help="device of the candidate (default cpu)")
    group.addoption(
        "--adapt-seq-len", type=int, help="sequence length of the alignment batch (default: chosen by the device)"
    )
    group.addoption("--adapt-thresholds", metavar="FILE", help="thresholds file (the `adapt gate` format)")
    group.addoption("--adapt-out", metavar="DIR", help="keep the run directory (report.json, report.html) here")
    group.addoption("--adapt-trust-remote-code", action="store_true", help="allow the checkpoint's own modelling code")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--adapt-model"):
        return
    name = f"adapt[{config.getoption('--adapt-model')}]"
    collector = AdaptAlignment.from_parent(session, name=name, nodeid=name)
    items.extend(collector.collect())


class AdaptAlignment(pytest.Collector):
    """Runs the alignment once and yields one item per stage and per compared tensor."""

    def collect(self) -> list[pytest.Item]:
        report = self._run()
        items: list[pytest.Item] = [
            StageItem.from_parent(self, name=f"stage[{entry['name']}]", entry=entry)
            for entry in report["stages"]
            if entry["name"] in _STAGES
        ]
        align = next(e for e in report["stages"] if e["name"] == "alignment")
        summary = align.get("summary") or {}
        for group, layers in (("align", summary.get("layers", [])), ("grad", summary.get("gradients", []))):
            items += [
                TensorItem.from_parent(self, name=f"{group}[{layer['name']}]", layer=layer, dtype=summary.get("dtype"))
                for layer in layers
            ]
        return items

    def _run(self) -> dict[str, Any]:
        from adapt.app.pipeline.options import RunOptions
        from adapt.app.pipeline.runner import run_pipeline
        from adapt.core.errors import AdaptError

        opt = self.config.getoption
        out_dir = opt("--adapt-out") or tempfile.mkdtemp(prefix="adapt-pytest-")
        options = RunOptions.from_dict(
            {
                "source": opt("--adapt-model"),
                "out_dir": out_dir,
                "stages": list(_STAGES),
                "force": True,
                "trust_remote_code": opt("--adapt-trust-remote-code"),
                "device": opt("--adapt-device"),
                "dtype": opt("--adapt-dtype"),
                "seq_len": opt("--adapt-seq-len"),
                "thresholds": opt("--adapt-thresholds"),
            }
        )
        try:
            return run_pipeline(options).report
        except AdaptError as err:  # a bad --adapt-* value is a usage error: one line, no traceback
            raise pytest.UsageError(f"--adapt-model: {err}") from None


class StageItem(pytest.Item):
    def __init__(self, *, entry: dict[str, Any], **kwargs: Any):
        super().__init__(**kwargs)
        self.entry = entry

    def runtest(self) -> None:
        entry = self.entry
        if entry["status"] != "passed":
            raise AdaptCheckFailure(
                f"{entry['name']} {entry['status']}: {entry.get('error') or entry.get('verdict', '')}"
            )

    def repr_failure(self, excinfo, style=None) -> str:  # noqa: ARG002 - pytest's signature
        return str(excinfo.value) if isinstance(excinfo.value, AdaptCheckFailure) else super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"adapt stage {self.entry['name']}"


class TensorItem(pytest.Item):
    def __init__(self, *, layer: dict[str, Any], dtype: str | None, **kwargs: Any):
        super().__init__(**kwargs)
        self.layer = layer
        self.dtype = dtype

    def runtest(self) -> None:
        layer = self.layer
        if not layer.get("passed"):
            from reports.tables import format_number

            keys = ("cosine", "rel_err", "max_abs", "err_ratio", "baseline_rel_err")
            metrics = ", ".join(f"{k}={format_number(layer.get(k))}" for k in keys)
            raise AdaptCheckFailure(
                f"{layer['name']} (block {layer.get('block')}) outside {self.dtype} limits: {metrics}"
            )

    def repr_failure(self, excinfo, style=None) -> str:  # noqa: ARG002
        return str(excinfo.value) if isinstance(excinfo.value, AdaptCheckFailure) else super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"adapt alignment {self.name}"


class AdaptCheckFailure(AssertionError):
    """A stage or tensor outside its limits; shown as its one-line message, not a traceback."""
