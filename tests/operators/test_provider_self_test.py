"""adapt-triton's self-test: each kernel family is checked against float64 when the plan is about to use it (the
winner of the timing, not every candidate), so a cold start compiles only what the model will run, and a family that
fails is not chosen while the rest still are."""

from __future__ import annotations

import pytest
from ops_testlib import CPU, kinds, recognised

from operators import kernels
from operators.mapping import _choose
from operators.profiles import load_profile
from operators.providers import adapt_triton, provider_status

pytest.importorskip("triton")


@pytest.fixture
def fresh_self_tests(monkeypatch, tmp_path):
    """No verdict remembered from earlier tests, on disk or in this process (both restored afterwards)."""
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    monkeypatch.setattr(adapt_triton, "_verdicts", {})


def test_a_family_that_fails_its_self_test_is_not_chosen_and_the_status_says_why(zoo, monkeypatch, fresh_self_tests):
    real = kernels.glu_linear
    monkeypatch.setattr(kernels, "glu_linear", lambda *a: real(*a) * 1.001)  # 0.1% off
    _, _, recognition = recognised(str(zoo("llama")))
    provider = adapt_triton.AdaptTritonProvider()
    (mlp, *_), (norm, *_) = kinds(recognition, "gated_mlp"), kinds(recognition, "rms_norm")
    (offered,) = provider.options(mlp, CPU)  # offered until its check has run
    choice = _choose(mlp, [provider], load_profile("cuda-hopper"), CPU, None)
    assert choice.provider is None and "its check failed (glu_linear_silu: result differs" in choice.note
    assert "glu_linear_silu: result differs from PyTorch" in offered.verify()
    assert provider.options(mlp, CPU) == []  # known to fail in this process: no longer offered
    assert [o.kernel for o in provider.options(norm, CPU)] == ["rms_norm"]
    status = provider_status(CPU)["adapt-triton"]
    assert status.startswith("available") and "glu_linear_silu: result differs from PyTorch" in status


def test_a_family_is_self_tested_only_when_its_kernel_is_to_be_used(zoo, monkeypatch, fresh_self_tests):
    ran = []
    real = adapt_triton._self_test
    monkeypatch.setattr(adapt_triton, "_self_test", lambda device, names: ran.extend(names) or real(device, names))
    _, _, recognition = recognised(str(zoo("llama")))
    provider = adapt_triton.AdaptTritonProvider()
    (mlp, *_) = kinds(recognition, "gated_mlp")
    (offered,) = provider.options(mlp, CPU)
    assert offered.kernel == "swiglu_linear" and ran == [adapt_triton.CANARY_CASE]  # offering runs the canary only
    assert offered.verify() is None and ran == [adapt_triton.CANARY_CASE, "glu_linear_silu"]
    assert offered.verify() is None and len(ran) == 2  # once per process
    assert provider_status(CPU)["adapt-triton"] == "available"


def test_every_case_passes_here():
    assert adapt_triton._self_test("cpu") is None
