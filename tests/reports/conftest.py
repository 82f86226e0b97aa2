"""Report fixtures: report.json files written by real ``adapt run`` runs (see make_report_fixtures.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"
FIXTURE_MODELS = ("tiny-llama", "qwen3_moe", "custom")


def _load(name: str) -> dict:
    return json.loads((DATA / f"{name}.report.json").read_text())


@pytest.fixture
def report() -> dict:
    """A fresh deep copy of the tiny-llama report (tests may mutate it)."""
    return copy.deepcopy(_load("tiny-llama"))


@pytest.fixture
def all_reports() -> dict[str, dict]:
    return {name: _load(name) for name in FIXTURE_MODELS}
