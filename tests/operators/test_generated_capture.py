"""Capturing a generated kernel runs the module on fresh inputs, apart from the graph the trace built and freed."""

from __future__ import annotations

import torch
from torch import nn

from operators.generated import capture_code, save_sources


class _Leaky(nn.Module):
    """Keeps its last output as a plain attribute and folds it into the next call (a recurrence's state)."""

    def __init__(self, width: int):
        super().__init__()
        self.mix = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.state = None

    def forward(self, x, extras):
        out = torch.tanh(x @ self.mix) + extras[0] * extras[1]
        if self.state is not None:
            out = out + self.state
        self.state = out
        return out


def test_capture_does_not_backpropagate_into_the_freed_trace(tmp_path):
    width = 6
    module = _Leaky(width)
    x = torch.randn(3, width, requires_grad=True)
    extras = (torch.randn(3, width, requires_grad=True), torch.randn(3, width, requires_grad=True))
    module(x, extras).sum().backward()  # the trace: its graph is freed, yet ``state`` and ``extras`` still point in
    before = module.state
    code = capture_code(module, (x, extras), {})
    assert code["sources"] and all(path.endswith(".py") for path in save_sources(code["sources"], "leaky", tmp_path))
    assert module.state is before  # the state the model left is restored after the capture


def test_a_capture_is_keyed_by_the_device_its_module_runs_on_even_without_parameters(monkeypatch):
    """A rotary module holds no parameters: its device and dtype come from its buffers or its inputs, so C++ code
    captured on the CPU is never handed to a run on another device."""
    from operators import api

    monkeypatch.setattr(api, "structure_key", lambda *args, **kwargs: ("same structure",))
    plain = nn.Module()
    on_cpu = api.capture_key(plain, None, None, (torch.empty(2),))
    on_meta = api.capture_key(plain, None, None, (torch.empty(2, device="meta", dtype=torch.float16),))
    assert on_cpu[-1] == ("inductor code", "cpu", "torch.float32")
    assert on_meta[-1] == ("inductor code", "meta", "torch.float16") and on_cpu[:-1] == on_meta[:-1]
    buffered = nn.Module()
    buffered.register_buffer("inv_freq", torch.ones(4, dtype=torch.float64, device="meta"))
    assert api.capture_key(buffered, None, None, (torch.empty(2),))[-1] == (
        "inductor code",
        "meta",
        "torch.float64",
    )
