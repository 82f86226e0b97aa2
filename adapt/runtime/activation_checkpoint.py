"""Activation checkpointing per block, as the plan's ``recompute`` says (``operators.recompute`` owns the policy)."""

from __future__ import annotations

from torch import nn

from operators.recompute import checkpoint_blocks


def apply_activation_checkpointing(blocks: nn.ModuleList | nn.ModuleDict, mode: str) -> None:
    """Make every block of ``blocks`` recompute in backward; ``mode`` is ``none``, ``selective`` or ``full``."""
    checkpoint_blocks(blocks.children(), mode)
