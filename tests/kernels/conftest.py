"""Kernel tests run the real Triton kernels; without CUDA they run in Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when a kernel is decorated; the root ``tests/conftest.py`` sets it before any test module
imports ``operators.kernels``.  The kernel modules are never reloaded: their ``torch.library`` operators are registered
once, and a reload would leave them bound to the old modules' state (the shared call counter among it).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET before any kernel import"

_real_empty, _real_empty_like = torch.empty, torch.empty_like


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype != torch.bool:
        return t.fill_(-(2**30))
    return t


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every ``torch.empty*`` during a test starts as NaN (or a huge negative int): unwritten output shows."""
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(_real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(_real_empty_like(*a, **k)))


@pytest.fixture(autouse=True)
def every_kernel_test_draws_fresh(fresh_seed):
    return fresh_seed
