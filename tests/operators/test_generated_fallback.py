"""A generated kernel whose module's code specialises on a changing size gives way to the module's own forward, and
says so, instead of crashing the caller at Dynamo's recompile limit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from operators.generated import compile_module


class _ScanOverTime(nn.Module):
    """A recurrence written as a Python loop over the sequence, as RecurrentGemma's scan is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            state = 0.5 * state + x[:, t]
            out.append(state)
        return torch.stack(out, dim=1)


def test_past_the_recompile_limit_the_module_runs_its_own_forward_and_says_so():
    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    module, said = _ScanOverTime(), []
    forward = compile_module(module, "model.layers.0.scan", said.append)
    # (torch's own patch: monkeypatch's undo deletes an entry of torch's config module)
    with torch._dynamo.config.patch(recompile_limit=2):
        with pytest.warns(
            UserWarning, match="model.layers.0.scan: its generated kernel recompiled past Dynamo's limit"
        ):
            for length in (3, 4, 5, 6, 7):
                x = torch.randn(2, length, 4, dtype=torch.float64)
                torch.testing.assert_close(forward(x), module.forward(x))
    assert len(said) == 1 and "runs its own forward" in said[0]
    assert torch._dynamo.config.recompile_limit == limit  # put back for every later test
