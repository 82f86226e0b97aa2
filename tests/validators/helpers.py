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


def swap_router_rows(block_index: int, a: int = 0, b: int = 1):
    """A transform that swaps two experts' router rows in one MoE block: a kernel that routes wrongly.

    The MoE is found by structure: the component holding 3-D expert banks; its router is the 2-D
    parameter with one row per expert and one column per hidden unit."""

    def transform(model: nn.Module) -> nn.Module:
        block = find_blocks(model).blocks[block_index]
        for _, component in components(block):
            banks = [p for p in component.parameters() if p.dim() == 3]
            if not banks:
                continue
            experts = banks[0].shape[0]
            router = next(p for p in component.parameters() if p.dim() == 2 and p.shape[0] == experts)
            with torch.no_grad():
                router[[a, b]] = router[[b, a]].clone()
            return model
        raise AssertionError(f"block {block_index} has no MoE component")

    return transform


def stale_linear_weights():
    """A transform that makes every linear layer of the blocks compute with its weight as it was at transform time (a
    kernel that caches its weights): gradients still reach the live weights, so only training shows it."""

    def transform(model: nn.Module) -> nn.Module:
        for block in find_blocks(model).blocks:
            for linear in [m for m in block.modules() if isinstance(m, nn.Linear)]:
                linear.forward = _stale_forward(linear)
        return model

    return transform


def _stale_forward(linear: nn.Linear):
    stale = linear.weight.detach().clone()

    def forward(x: torch.Tensor) -> torch.Tensor:
        live = linear.weight
        return nn.functional.linear(x, stale + (live - live.detach()), linear.bias)

    return forward
