"""Finding blocks and components by structure, and capturing their outputs with hooks.

The block list is the largest ``nn.ModuleList`` whose entries share one structure (same
parameter names and shapes); components are a block's direct children that own parameters.
No class names, no ``model_type``: this works for a remote-code model as for Llama.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adapt.core.errors import BadInput


def _structure(module: nn.Module) -> tuple:
    return tuple((name, tuple(p.shape)) for name, p in module.named_parameters())


@dataclass
class BlockList:
    path: str  # e.g. "model.layers"
    blocks: list[nn.Module]

    def block_path(self, index: int) -> str:
        return f"{self.path}.{index}"


def find_blocks(model: nn.Module) -> BlockList:
    """The repeated-block list: the ``ModuleList`` of structurally alike modules holding the most parameters.

    MoE stacks with a few dense leading layers (DeepSeek-V3) still qualify: entries must share
    their *set of child names* rather than every parameter shape, so a dense and an MoE
    decoder layer in the same list count as one block list.
    """
    best: BlockList | None = None
    best_size = 0
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        entries = list(module)
        if not all(any(True for _ in e.parameters()) for e in entries):
            continue
        children = {tuple(sorted(n for n, _ in e.named_children())) for e in entries}
        if len(children) != 1 and len({_structure(e) for e in entries}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best_size:
            best, best_size = BlockList(path=path, blocks=entries), size
    if best is None:
        raise BadInput("no repeated block list (a ModuleList of identical layers) found in the model")
    return best


def components(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """A block's direct children that own parameters (norms, attention, MLP, novel ops)."""
    return [(name, child) for name, child in block.named_children() if any(True for _ in child.parameters())]


def first_tensor(output) -> torch.Tensor | None:
    """The primary tensor of a module output (tensor, tuple/list, or a ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        for key in ("logits", "last_hidden_state"):
            if isinstance(output.get(key), torch.Tensor):
                return output[key]
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


@dataclass
class Probe:
    """Where a captured tensor came from."""

    name: str
    block: int | None
    component: str | None


def probes(model: nn.Module, blocks: BlockList) -> list[tuple[Probe, nn.Module]]:
    """Hook points: every block, every component inside each block."""
    found = []
    for index, block in enumerate(blocks.blocks):
        path = blocks.block_path(index)
        for name, child in components(block):
            found.append((Probe(f"{path}.{name}", index, name), child))
        found.append((Probe(path, index, None), block))
    return found


@dataclass
class Recording:
    """Outputs in the order the hooks fired; repeated calls of one module get ``#n`` suffixes."""

    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    where: dict[str, Probe] = field(default_factory=dict)
    routing: Any = None  # validators.routing.RoutingRecording when MoE top-k choices were recorded too


@contextlib.contextmanager
def record_outputs(points: list[tuple[Probe, nn.Module]]) -> Iterator[Recording]:
    """Record a detached copy of each probe's output, in execution order."""
    rec = Recording()
    handles = []

    def make_hook(probe: Probe):
        def hook(_module, _args, output):
            tensor = first_tensor(output)
            if tensor is None:
                return
            key, n = probe.name, 1
            while key in rec.outputs:
                n += 1
                key = f"{probe.name}#{n}"
            rec.outputs[key] = tensor.detach().clone()
            rec.where[key] = probe

        return hook

    try:
        for probe, module in points:
            handles.append(module.register_forward_hook(make_hook(probe)))
        yield rec
    finally:
        for handle in handles:
            handle.remove()


class NonFiniteOutput(RuntimeError):
    def __init__(self, module_path: str):
        super().__init__(f"module {module_path or '<model>'} produced NaN/Inf")
        self.module_path = module_path


@contextlib.contextmanager
def stop_on_nonfinite(model: nn.Module) -> Iterator[None]:
    """Abort the forward at the first module whose output is not finite, naming that module.

    Forward hooks fire innermost-first, so the first module to report is the one that produced it.
    """
    handles = []

    def make_hook(path: str):
        def hook(_module, _args, output):
            tensor = first_tensor(output)
            if tensor is not None and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise NonFiniteOutput(path)

        return hook

    try:
        for path, module in model.named_modules():
            handles.append(module.register_forward_hook(make_hook(path)))
        yield
    finally:
        for handle in handles:
            handle.remove()
