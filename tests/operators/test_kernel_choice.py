"""Choosing among kernels by measurement on CUDA: the module's own traced path competes for hidden->hidden kinds.

There is no GPU here, so the timing itself (``operators.benchmark.measure``) is replaced by given figures; what
is checked is which candidates are timed, that the fastest wins even when it is the model's own path, that
the choice says why, and that the cache answers the second time.
"""

from __future__ import annotations

import torch
from torch import nn

from operators import benchmark
from operators.mapping import _choose
from operators.recognition import Component
from operators.registry import KernelOption, Target

CUDA = Target("cuda", "bfloat16", True, (9, 0))


class Provider:
    def __init__(self, name: str, options: list[KernelOption]):
        self.name, self._options = name, options

    def options(self, component, target):
        return self._options


def provider_options():
    kernel = KernelOption("kernels", "grouped", "fused", lambda module, component: module.forward)
    traced = KernelOption("native", "as traced", "native", None)
    return [Provider("kernels", [kernel]), Provider("native", [traced])]


class Profile:
    codegen = "triton"

    def supports_aten(self, *args) -> bool:
        return True


def test_the_models_own_path_wins_when_it_is_faster(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "test device")
    timed: list[list[str]] = []

    def measure(options, comp, target, module):
        timed.append([f"{o.provider}:{o.kernel}" for o in options])
        return {"kernels:grouped": 2.5, "native:as traced": 1.5}

    monkeypatch.setattr(benchmark, "measure", measure)
    model = nn.Sequential(nn.Linear(8, 8))
    moe = Component("0", "moe", {"width": 8, "top_k": 2}, True)
    choice = _choose(moe, provider_options(), Profile(), CUDA, model)
    assert timed == [["kernels:grouped", "native:as traced"]]
    assert (choice.provider, choice.status, choice.patch) == ("native", "native", False)
    assert "kernels:grouped 2.500 ms" in choice.note and "native:as traced 1.500 ms" in choice.note
    again = _choose(moe, provider_options(), Profile(), CUDA, model)  # from the cache: not timed again
    assert len(timed) == 1 and again.provider == "native"

    # attention has no hidden->hidden forward to time: its one fused kernel is taken without timing
    attention = Component("0", "attention", {"width": 8}, True)
    assert _choose(attention, provider_options(), Profile(), CUDA, model).provider == "kernels" and len(timed) == 1
