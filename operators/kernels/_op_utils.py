"""What every module of ``torch.ops.adapt`` operators shares: the count of real executions, and the empty
placeholder that stands for an output not asked for (see ``ops`` for the conventions)."""

from __future__ import annotations

from collections import Counter

import torch

CALLS: Counter[str] = Counter()  # adapt operator name -> real (non-fake) executions


def none_if_empty(t: torch.Tensor) -> torch.Tensor | None:
    """A gradient output back to autograd's None when it is the empty placeholder."""
    return t if t.numel() else None


def no_gradient(like: torch.Tensor) -> torch.Tensor:
    """The empty output standing for something not asked for (a gradient, forward statistics)."""
    return like.new_empty(0)
