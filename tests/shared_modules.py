"""Small modules that tests in several packages build their cases from (importable: pytest puts ``tests/`` on the
path with its conftest)."""

from __future__ import annotations

import torch
from torch import nn


class ScanOverTime(nn.Module):
    """A recurrence written as a Python loop over the sequence, as RecurrentGemma's scan is: compiled, it recompiles
    for every new length."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            state = 0.5 * state + x[:, t]
            out.append(state)
        return torch.stack(out, dim=1)
