"""Activation checkpointing per block, as the plan's ``recompute`` says.

``full`` recomputes the whole block in backward.  ``selective`` saves the outputs of matmuls and
attention kernels (expensive to redo, cheap to keep relative to their FLOPs) and recomputes the
pointwise work around them (norms, activations, rotary, residual adds).  Wrapping uses
``checkpoint_wrapper``, whose state-dict hooks keep the HF parameter names.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(blocks: nn.ModuleList | nn.ModuleDict, mode: str) -> None:
    """Wrap every block of ``blocks`` in place; ``mode`` is ``none``, ``selective`` or ``full``."""
    if mode == "none":
        return
    wrap = partial(checkpoint_wrapper, preserve_rng_state=False)
    if mode == "selective":
        wrap = partial(wrap, context_fn=_selective_context)
    for key, block in list(blocks.named_children()):
        blocks.register_module(key, wrap(block))
