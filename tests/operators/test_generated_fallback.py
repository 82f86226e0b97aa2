"""A generated kernel whose module's code specialises on a changing size gives way to the module's own forward, and
says so, instead of crashing the caller at Dynamo's recompile limit."""

from __future__ import annotations

import pytest
import torch
from shared_modules import ScanOverTime
from torch import nn

from operators.generated import compile_module


def test_past_the_recompile_limit_the_module_runs_its_own_forward_and_says_so():
    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    module, said = ScanOverTime(), []
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


class _RefusesSingleTokens(nn.Module):
    """A module whose own code raises on a path the plan never ran (xLSTM's cached decode): one token at a time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            raise ValueError(f"state has wrong shape, got {tuple(x.shape)}")
        return x.cumsum(dim=1)


class _BreaksOnShortInputs(nn.Module):
    """A module whose short-input path branches on a value: a graph break that its eager forward runs fine."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] < 3:
            return x * 2 if x.sum() > 0 else x * 3
        return x.cumsum(dim=1)


def test_a_path_dynamo_cannot_capture_runs_the_modules_forward_and_raises_its_own_error():
    torch._dynamo.reset()
    module, said = _RefusesSingleTokens(), []
    forward = compile_module(module, "backbone.blocks.0.mlstm_layer", said.append)
    x = torch.randn(2, 5, 4)
    torch.testing.assert_close(forward(x), x.cumsum(dim=1))
    with pytest.warns(UserWarning, match="backbone.blocks.0.mlstm_layer: Dynamo cannot capture"):
        with pytest.raises(ValueError, match="state has wrong shape"):  # the module's own error, not Dynamo's
            forward(torch.randn(2, 1, 4))
    assert len(said) == 1 and "runs its own forward" in said[0] and "state has wrong shape" in said[0]
    torch.testing.assert_close(forward(x), x.cumsum(dim=1))  # its own forward from then on, still right


def test_a_graph_break_on_a_new_path_gives_way_to_the_modules_forward_with_the_right_result():
    torch._dynamo.reset()
    module, said = _BreaksOnShortInputs(), []
    forward = compile_module(module, "", said.append)
    long, short = torch.randn(2, 6, 4), torch.randn(2, 2, 4)
    torch.testing.assert_close(forward(long), long.cumsum(dim=1))
    with pytest.warns(UserWarning, match="_BreaksOnShortInputs: Dynamo cannot capture"):
        torch.testing.assert_close(forward(short), short * (2 if short.sum() > 0 else 3))
    assert len(said) == 1
