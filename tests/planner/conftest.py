"""Fixtures the planner tests share: a spec JSON file, and DeepSeek-V3 config-only through intake."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.planner.specs import decoder_spec


@pytest.fixture(scope="session")
def deepseek_v3_dir(tmp_path_factory):
    """DeepSeek-V3's published config, config-only (no weights)."""
    from transformers import DeepseekV3Config

    path = tmp_path_factory.mktemp("deepseek_v3")
    DeepseekV3Config().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def deepseek_v3_spec(deepseek_v3_dir):
    from adapt.model.intake import inspect

    return inspect(str(deepseek_v3_dir), config_only=True)


@pytest.fixture(scope="session")
def spec_json(tmp_path_factory):
    """A ModelSpec JSON file (what ``adapt inspect --json`` writes) of a 1B-class decoder."""
    path = tmp_path_factory.mktemp("spec") / "spec.json"
    path.write_text(
        json.dumps(dataclasses.asdict(decoder_spec(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8)))
    )
    return path
