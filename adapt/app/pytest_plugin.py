"""pytest plugin: ``pytest --adapt-model SOURCE [--adapt-dtype bf16]`` makes every aligned block and
component its own test item, so a CI run lists ``model.layers.1.mlp`` as the test that failed.

The plugin runs the pipeline's intake, operators and alignment stages once per session (always
recomputed, never taken from a cache), then collects one item per compared tensor plus one per
stage.  Registered through the ``pytest11`` entry point ``adapt``; without ``--adapt-model`` it
does nothing.  Its options are fields of ``adapt run``'s options tree, added from the tree: each is
``--adapt-`` and the field's ``adapt run`` flag, with that flag's default, type and help (so the run
directory is ``adapt run``'s, ``adapt-runs/<name>``, unless ``--adapt-out`` names another).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from adapt.app.options import argument_keywords, default_of, flag_name, flag_spec, groups, option_fields
from adapt.app.pipeline.options import RunOptions

_STAGES = ["intake", "operators", "alignment"]
# The options-tree fields a pytest run sets; the stages and a fresh computation are the plugin's own choice.
PLUGIN_FIELDS = ("source", "trust_remote_code", "out_dir", "device", "dtype", "seq_len", "thresholds")
PREFIX = "--adapt-"


def plugin_options() -> dict[str, dataclasses.Field]:
    """Each plugin flag and the options-tree field it sets: ``--out`` is ``--adapt-out``; the checkpoint, positional
    on the command line, is named after the group that holds it (``--adapt-model``)."""
    options = {}
    for group_name, cls in groups(RunOptions):
        for field in option_fields(cls):
            if field.name in PLUGIN_FIELDS:
                name = group_name if flag_spec(field).flag is None else flag_name(field).removeprefix("--")
                options[PREFIX + name] = field
    return options


def dest(field: dataclasses.Field) -> str:
    """Where pytest keeps a field's value: its tree name, prefixed apart from pytest's own options."""
    return f"adapt_{field.name}"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("adapt", "adapt model alignment: one test per aligned block and component")
    for name, field in plugin_options().items():
        group.addoption(
            name, dest=dest(field), default=default_of(field), help=flag_spec(field).help, **argument_keywords(field)
        )


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
        from adapt.app.pipeline.runner import run_pipeline
        from adapt.core.errors import AdaptError

        values = {field.name: self.config.getoption(dest(field)) for field in plugin_options().values()}
        try:
            return run_pipeline(RunOptions.from_dict({**values, "stages": list(_STAGES), "force": True})).report
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
