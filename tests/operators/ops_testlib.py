"""Shared helpers for the operators tests: load a zoo model through intake and run the stage's pieces."""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from adapt.model.intake import load_model, resolve_source
from operators import plan_kernels, recognise
from operators.inventory import trace_model
from operators.profiles import load_profile
from operators.registry import Target

CPU = Target("cpu", "float32", True, None)


class HandRMSNorm(nn.Module):
    """A hand-written RMSNorm under names no convention uses."""

    def __init__(self, width: int, tiny: float):
        super().__init__()
        self.scale_vec = nn.Parameter(torch.ones(width))
        self.tiny = tiny

    def forward(self, h):
        return self.scale_vec * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.tiny)


def load(path, **flags):
    return load_model(resolve_source(str(path), trust_remote_code=True, **flags), dtype=torch.float32)


@cache
def recognised(path: str):
    """(model, inventory, recognition) for a zoo checkpoint, cached per test session."""
    model = load(path)
    inventory = trace_model(model)
    return model, inventory, recognise(model, inventory)


def planned(path: str, profile: str = "cuda-hopper", target: Target | None = None):
    model, inventory, recognition = recognised(path)
    return model, plan_kernels(inventory, recognition, load_profile(profile), target or Target.here())


def kinds(recognition, kind: str, confirmed_only: bool = True):
    return [c for c in recognition.components if c.kind == kind and (c.confirmed or not confirmed_only)]


def count_kernel_calls(monkeypatch, name: str, record) -> list:
    """Wrap ``operators.kernels.<name>`` so each call appends ``record(args, kwargs)`` to the returned list.

    The adapt-triton provider is asked first, so its cached self-test has already run and is not counted.
    """
    from operators import kernels
    from operators.providers.adapt_triton import AdaptTritonProvider

    assert AdaptTritonProvider().available(Target("cpu", "float32", True, None)) == (True, "")
    calls: list = []
    real = getattr(kernels, name)

    def counted(*args, **kwargs):
        calls.append(record(args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, name, counted)
    return calls


def assert_patched_moe_matches_float64(module: nn.Module, patched_forward, x: torch.Tensor) -> None:
    """``patched_forward`` (the kernel path installed for ``module``) against ``module`` itself in float64: output,
    input gradient and every parameter's gradient (each nonzero).  ``x`` is drawn away from routing near-ties."""
    import copy

    reference = copy.deepcopy(module).double()
    x64 = x.double().requires_grad_()
    reference(x64).pow(2).sum().backward()
    module.zero_grad(set_to_none=True)  # a trace may have run a backward through the module itself
    x32 = x.clone().requires_grad_()
    out = patched_forward(x32)
    out.double().pow(2).sum().backward()
    torch.testing.assert_close(out.double(), reference(x64).detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)
    expected = dict(reference.named_parameters())
    for name, param in module.named_parameters():
        assert param.grad is not None and float(param.grad.abs().max()) > 0, name
        torch.testing.assert_close(param.grad.double(), expected[name].grad, rtol=1e-4, atol=1e-4, msg=name)
