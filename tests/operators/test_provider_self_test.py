"""adapt-triton's self-test: each kernel family is checked against float64 when a component first asks for it, so a
cold start compiles only what the model can use, and a family that fails is not offered while the rest still are."""

from __future__ import annotations

import pytest
from ops_testlib import CPU, kinds, recognised

from operators import kernels
from operators.providers import adapt_triton, provider_status

pytest.importorskip("triton")


@pytest.fixture
def fresh_self_tests(monkeypatch, tmp_path):
    """No verdict remembered from earlier tests, on disk or in this process (both restored afterwards)."""
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    monkeypatch.setattr(adapt_triton, "_verdicts", {})


def test_a_failed_family_is_not_offered_and_the_status_says_why(zoo, monkeypatch, fresh_self_tests):
    real = kernels.glu_linear
    monkeypatch.setattr(kernels, "glu_linear", lambda *a: real(*a) * 1.001)  # 0.1% off
    _, _, recognition = recognised(str(zoo("llama")))
    provider = adapt_triton.AdaptTritonProvider()
    (mlp, *_), (norm, *_) = kinds(recognition, "gated_mlp"), kinds(recognition, "rms_norm")
    assert provider.options(mlp, CPU) == []
    assert [o.kernel for o in provider.options(norm, CPU)] == ["rms_norm"]
    status = provider_status(CPU)["adapt-triton"]
    assert status.startswith("available") and "glu_linear_silu: result differs from PyTorch" in status


def test_only_the_asked_families_run(zoo, monkeypatch, fresh_self_tests):
    ran = []
    real = adapt_triton._self_test
    monkeypatch.setattr(adapt_triton, "_self_test", lambda device, names: ran.extend(names) or real(device, names))
    _, _, recognition = recognised(str(zoo("llama")))
    provider = adapt_triton.AdaptTritonProvider()
    (mlp, *_) = kinds(recognition, "gated_mlp")
    assert [o.kernel for o in provider.options(mlp, CPU)] == ["swiglu_linear"]
    assert ran == [adapt_triton.CANARY_CASE, "glu_linear_silu"]
    assert provider_status(CPU)["adapt-triton"] == "available"


def test_every_case_passes_here():
    assert adapt_triton._self_test("cpu") is None
