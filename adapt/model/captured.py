"""Inputs captured from one forward and given to another call of the same module."""

from __future__ import annotations

import copy
from collections.abc import MutableMapping
from typing import Any

import torch


def fresh_input(value: Any) -> Any:
    """A captured input as a new call should receive it: tensors detached from the graph they were captured in (its
    backward may have freed it), and containers copied, so that a module writing into one (a layer storing its K/V
    for a later layer to share) neither changes the capture nor hands the next call a tensor of this call's graph."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, MutableMapping):
        copied = copy.copy(value)  # the same mapping type (transformers' KV-sharing UserDict)
        for key in value:
            copied[key] = fresh_input(value[key])
        return copied
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(fresh_input(v) for v in value)
    return value
