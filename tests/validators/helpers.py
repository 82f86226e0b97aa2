"""Candidate transforms for the validator tests: deliberately broken kernels, found by structure."""

from __future__ import annotations

import torch
from torch import nn

from validators.modules import components, find_blocks


def first_norm(block: nn.Module) -> tuple[str, nn.Module]:
    """The first component of a block whose parameters are all 1-D (a normalisation layer)."""
    for name, child in components(block):
        if all(p.dim() == 1 for p in child.parameters()) and not list(child.children()):
            return name, child
    raise AssertionError("no normalisation component found")


def scale_norm_output(block_index: int, factor: float):
    """A transform that multiplies one block's first norm output by ``factor`` (a broken norm kernel)."""

    def transform(model: nn.Module) -> nn.Module:
        blocks = find_blocks(model)
        _, norm = first_norm(blocks.blocks[block_index])
        norm.register_forward_hook(lambda _m, _a, out: out * factor)
        return model

    return transform


def poison_output(block_index: int, component: str):
    """A transform that writes one NaN into a component's output."""

    def transform(model: nn.Module) -> nn.Module:
        blocks = find_blocks(model)
        module = dict(components(blocks.blocks[block_index]))[component]

        def hook(_m, _a, out):
            out = out.clone() if isinstance(out, torch.Tensor) else out
            out.view(-1)[3] = float("nan")
            return out

        module.register_forward_hook(hook)
        return model

    return transform
