"""Kernel tests run the real Triton kernels; without CUDA they run in Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here before the kernel modules
are imported, and any kernel module imported earlier in the session (by another test folder) is
reloaded so its kernels are rebuilt for the interpreter.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for _name in sorted(n for n in sys.modules if n.startswith("operators.kernels.")):
        importlib.reload(sys.modules[_name])
    if "operators.kernels" in sys.modules:
        importlib.reload(sys.modules["operators.kernels"])

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
