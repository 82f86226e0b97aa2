"""Shared fixtures: the tiny-checkpoint zoo is built once per test session."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU, adapt's Triton kernels run in Triton's CPU interpreter. The variable is read when a
# kernel is decorated, so it is set before any test module imports operators.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from adapt.model.zoo import ZOO_NAMES, build_tiny_checkpoint


@pytest.fixture(scope="session", autouse=True)
def session_adapt_cache(tmp_path_factory):
    """adapt's on-disk caches (kernel timings, self-tests, probe verdicts) in one directory per test session,
    set in the environment so CLI subprocesses share it: no verdict or timing leaks in from an earlier
    session's code or out into the user's cache.  Tests about the caches point it elsewhere themselves."""
    previous = os.environ.get("ADAPT_CACHE")
    os.environ["ADAPT_CACHE"] = str(tmp_path_factory.mktemp("adapt-cache"))
    yield
    if previous is None:
        os.environ.pop("ADAPT_CACHE", None)
    else:
        os.environ["ADAPT_CACHE"] = previous


@pytest.fixture(scope="session", autouse=True)
def kernel_self_tests_before_any_kernel_is_poisoned(session_adapt_cache):
    """adapt-triton self-tests a kernel family when a plan first asks for it.  Tests that poison a kernel (to show
    that the patch is what runs) would otherwise be the first to ask, fail its self-test and leave the family off
    for the rest of the session: every case runs once, unpatched, before any test."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from operators.providers import adapt_triton
    except ImportError:  # no Triton: the provider reports itself unavailable
        return
    adapt_triton.self_test_everything("cpu")


@pytest.fixture(scope="session")
def zoo_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="session")
def zoo(zoo_root):
    """``zoo(name) -> Path`` of a tiny checkpoint, built on first use and reused afterwards."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_checkpoint(name, zoo_root / name)
        return built[name]

    return get


@pytest.fixture(params=ZOO_NAMES)
def zoo_model(request, zoo):
    """Parametrised over every zoo family: yields (name, checkpoint dir)."""
    return request.param, zoo(request.param)


_SEED = pytest.StashKey[int]()


@pytest.fixture(autouse=True)
def test_seed(request) -> int:
    """One seed per test, new every run (``ADAPT_TEST_SEED`` replays it; a failure names it).

    It seeds Python's ``random`` in every test; torch only in tests that ask for ``fresh_seed``, so a
    test that never asked keeps the draws it was written against.
    """
    replay = os.environ.get("ADAPT_TEST_SEED")
    seed = int(replay) if replay else int.from_bytes(os.urandom(4), "little")
    random.seed(seed)
    request.node.stash[_SEED] = seed
    return seed


@pytest.fixture
def fresh_seed(test_seed: int) -> int:
    """Fresh torch draws for this test, from its seed."""
    torch.manual_seed(test_seed)
    return test_seed


@pytest.fixture
def rng(test_seed: int) -> random.Random:
    """A Python generator of its own from the test's seed, so shape draws replay with ``ADAPT_TEST_SEED``."""
    return random.Random(test_seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Adds the seed to a failed test's report; printing it would mix it into output a test reads with capsys."""
    report = yield
    if report.failed and _SEED in item.stash:
        report.sections.append(("random seed", f"replay with ADAPT_TEST_SEED={item.stash[_SEED]}"))
    return report
