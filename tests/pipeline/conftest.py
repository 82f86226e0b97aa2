"""Fixtures for the pipeline tests: a private copy of the bundled example and one full run."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from pipeline_helpers import EXAMPLE, adapt_run


@pytest.fixture
def example_copy(tmp_path) -> Path:
    """A writable copy of examples/tiny-llama (tests modify sources to check cache invalidation)."""
    return Path(shutil.copytree(EXAMPLE, tmp_path / "tiny-llama"))


@pytest.fixture(scope="session")
def example_run(tmp_path_factory) -> tuple[int, Path, float]:
    """One full ``adapt run`` of the bundled example: (exit code, run dir, seconds)."""
    out = tmp_path_factory.mktemp("example-run")
    start = time.perf_counter()
    code = adapt_run(EXAMPLE, out)
    return code, out, time.perf_counter() - start
