"""Finding blocks and components by structure, and capturing their outputs with hooks.

The block list is ``adapt.model.blocks.find_blocks``'s answer (re-exported here for the validators);
components are a block's direct children that own parameters.
No class names, no ``model_type``: this works for a remote-code model as for Llama.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adapt.model.blocks import BlockList, find_blocks

__all__ = ["BlockList", "components", "find_blocks", "first_tensor", "probes", "record_outputs", "stop_on_nonfinite"]


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
    """Record a detached copy of each probe's output: in execution order where the hooks ran eagerly, in probe order
    where they ran inside compiled code.  Each probe appends to a list of its own, which Dynamo traces inside a
    compiled block without compiling it anew for every block (a dict shared by all probes is guarded on its length,
    so each block would get its own graph, and those past Dynamo's recompile limit would run eagerly)."""
    slots: list[list[torch.Tensor]] = [[] for _ in points]
    order: list[int] = []

    def make_hook(index: int, slot: list[torch.Tensor]):
        def hook(_module, _args, output):
            tensor = first_tensor(output)
            if tensor is not None:
                slot.append(tensor.detach().clone())
                if not torch.compiler.is_compiling():
                    order.append(index)

        return hook

    rec = Recording()
    handles = [module.register_forward_hook(make_hook(i, slots[i])) for i, (_, module) in enumerate(points)]
    try:
        yield rec
    finally:
        for handle in handles:
            handle.remove()
    taken = [0] * len(points)
    for index in order + [i for i, slot in enumerate(slots) for _ in slot]:
        if taken[index] < len(slots[index]):
            probe, tensor = points[index][0], slots[index][taken[index]]
            taken[index] += 1
            key = probe.name if taken[index] == 1 else f"{probe.name}#{taken[index]}"
            rec.outputs[key], rec.where[key] = tensor, probe


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
