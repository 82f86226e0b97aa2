"""The activations adapt can name, as reference functions.

Intake names a module's activation by the numbers it computes, and the operators' probes name the one inside an
MLP or an expert bank the same way: one table, so that both say the same name for the same function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}

# Configs name some of these functions otherwise; intake falls back on a config's name only when the numbers
# named nothing, and the intake/operators comparison reads both sides through this one table.
ACTIVATION_ALIASES: dict[str, str] = {
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_python": "gelu",
    "gelu_python_tanh": "gelu_tanh",
}


def canonical_activation(name: str) -> str:
    """``name`` as ``ACTIVATIONS`` spells it (a config's alias resolved); other names unchanged."""
    return ACTIVATION_ALIASES.get(name, name)
