"""Fused residual-add + RMSNorm where the add runs in a block's own code (a decoder layer's forward).

There is no module to replace for ``h = residual + branch``: it is a line of the block's forward.
Recognition traced where that line runs: after which direct child of the block returned (the
attention, say) and how many adds the block ran since.  Hooks on the block's direct children open a
window when that child returns and close it when the next child starts; only inside the window is a
``TorchFunctionMode`` on the stack, so nothing in attention or the MLP pays for it.  At the traced
add the mode runs ``add_rms_norm``, returns the sum and keeps the normalised output for the norm,
whose forward hands it back when it receives exactly that sum.

Everything hangs on the children's hooks, never on the block's forward, because activation
checkpointing may recompute the block's class forward without passing through the instance: the
recomputation must fuse exactly as the forward did.  Anything off the traced path (operands the
kernel cannot take, a sum the norm does not receive) runs unfused and is counted as a miss, so
correctness never depends on the block following the trace.

Dynamo traces all of it (hooks, the mode's entry and exit, the add, the hand-over) into one graph
with the ``adapt::add_rms_norm`` operator in it.  While tracing, two things change: whether a child
returned into its block is judged by the block's own hooks bracketing the call (frames cannot be
inspected), and the per-pair counters stay still (a count in a traced graph would be a constant
guarded on every call); ``operators.kernels.ops.CALLS`` counts the compiled runs.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from operators import kernels
from operators.recognition.component import Component, local_path

_FRAMES_TO_BLOCK = 8  # hook -> Module._call_impl / _wrapped_call_impl -> the block's forward (and its wrappers)
# How ``a + b`` reaches a TorchFunctionMode differs across torch versions; every spelling counts.
_ADDS = frozenset({torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.add})


@dataclass
class FusionTarget:
    """One recognised (add -> norm) pair inside a block, with what happened to it so far."""

    norm: nn.Module
    path: str
    after: str  # the block's direct child the add follows (name relative to the block)
    add_index: int  # adds the block runs after that child before this one
    eps: float
    offset: float
    cast: str
    weight: str
    fused: int = 0  # norm calls served by the fused kernel
    missed: int = 0  # fused sums the norm did not receive, or traced adds that ran unfused

    @property
    def key(self) -> tuple[str, int]:
        return self.after, self.add_index

    def tally(self, what: str) -> None:
        """Count an outcome in eager runs; a no-op while Dynamo traces (see the module docstring)."""
        if not torch.compiler.is_compiling():
            setattr(self, what, getattr(self, what) + 1)


class _WindowAdds(TorchFunctionMode):
    """On the stack only between a child's return and the next child's start; acts on additions."""

    def __init__(self, fusion: ResidualFusion):
        super().__init__()
        self.fusion = fusion

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _ADDS and len(args) == 2 and not kwargs:
            return self.fusion.on_add(func, args)
        return func(*args, **(kwargs or {}))


@dataclass
class ResidualFusion:
    """Everything installed on one block: its targets, the window mode, the hooks, the pending results."""

    block: nn.Module
    targets: dict[tuple[str, int], FusionTarget] = field(default_factory=dict)  # (after, add_index) -> target
    window: str | None = None  # the child whose return opened the current window
    adds_in_window: int = 0
    pending: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )  # key -> (sum, normed)
    hooks: list[Any] = field(default_factory=list)
    openers: set[str] = field(default_factory=set)  # children whose return opens a window
    running: int = 0  # the block's forwards in progress (entry minus exit hooks)

    def __post_init__(self) -> None:
        self.mode = _WindowAdds(self)
        self.hooks.append(self.block.register_forward_pre_hook(self._block_enters))
        self.hooks.append(self.block.register_forward_hook(self._block_exits, always_call=True))
        for child in self.block.children():
            self.hooks.append(child.register_forward_pre_hook(self._child_starts, prepend=True))

    def add(self, target: FusionTarget) -> None:
        key = target.key
        if key in self.targets:
            raise RuntimeError(f"{target.path}: that add already feeds another fused norm")
        self.targets[key] = target
        if target.after not in self.openers:
            self.openers.add(target.after)
            self.hooks.append(
                self.block.get_submodule(target.after).register_forward_hook(
                    self._returned(target.after), always_call=True
                )
            )

    def on_add(self, func, args):
        target = self.targets.get((self.window, self.adds_in_window))
        self.adds_in_window += 1
        if target is not None:
            weight = getattr(target.norm, target.weight)
            if _fusable(args[0], args[1], weight):
                total, normed = kernels.add_rms_norm(args[0], args[1], weight, target.eps, target.offset, target.cast)
                if self.pending.pop(target.key, None) is not None:
                    target.tally("missed")
                self.pending[target.key] = (total, normed)
                return total
            target.tally("missed")
        return func(*args)

    def norm_output(self, target: FusionTarget, x: torch.Tensor) -> torch.Tensor | None:
        """The fused result when ``x`` is the sum computed for this norm, else None (the norm runs itself)."""
        entry = self.pending.pop(target.key, None)
        if entry is None:
            return None
        if entry[0] is x:
            target.tally("fused")
            return entry[1]
        target.tally("missed")
        return None

    def _open(self, child: str) -> None:
        self.window, self.adds_in_window = child, 0
        self.mode.__enter__()

    def _close(self) -> None:
        if self.window is not None:
            self.window = None
            self.mode.__exit__(None, None, None)

    def _child_starts(self, module, args) -> None:
        self._close()

    def _returned(self, name: str):
        def hook(module, args, output) -> None:
            self._close()
            if self._called_from_block():
                self._open(name)

        return hook

    def _called_from_block(self) -> bool:
        """Whether the child returned into the block's own forward (not a call from elsewhere, which would
        leave the mode on the stack with no block hook to take it off).  The forward's frame is a few
        frames up, past ``Module.__call__``; it may be the class forward run by a checkpoint recompute.
        While Dynamo traces, frames are out of reach: the block's hooks say whether it is running."""
        if torch.compiler.is_compiling():
            return self.running > 0
        frame = sys._getframe(2)
        for _ in range(_FRAMES_TO_BLOCK):
            if frame is None:
                return False
            if frame.f_locals.get("self") is self.block:
                return True
            frame = frame.f_back
        return False

    def _block_enters(self, module, args) -> None:
        self._block_edge()
        self.running += 1

    def _block_exits(self, module, args, output) -> None:
        self._block_edge()
        self.running = max(self.running - 1, 0)

    def _block_edge(self) -> None:
        """Block entry or exit: no window stays open, and a sum nobody consumed was a miss."""
        self._close()
        for target in self.targets.values():
            if self.pending.pop(target.key, None) is not None:
                target.tally("missed")

    def remove(self) -> None:
        self._close()
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


def _plain(t: Any) -> bool:
    """A dense tensor the kernel can take: no subclass (DTensor, ...) but the fake tensors of a trace."""
    return type(t) in (torch.Tensor, nn.Parameter) or isinstance(t, FakeTensor)


def _fusable(a: Any, b: Any, weight: torch.Tensor) -> bool:
    """Plain dense tensors of one float dtype, shape and device, as wide as the norm's weight."""
    return (
        _plain(a)
        and _plain(b)
        and _plain(weight)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device == weight.device
        and a.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and a.dim() >= 1
        and a.shape[-1] == weight.numel()
    )


_FUSIONS: weakref.WeakKeyDictionary[nn.Module, ResidualFusion] = weakref.WeakKeyDictionary()


@dataclass
class InstalledPair:
    """What ``apply_kernel_plan`` keeps: the norm's new forward, the target's counters, and the undo."""

    norm: nn.Module
    forward: Any
    target: FusionTarget
    fusion: ResidualFusion

    def release(self) -> None:
        """Take this pair out of its block; the last pair out removes the hooks."""
        fusion = self.fusion
        if fusion.targets.get(self.target.key) is self.target:
            del fusion.targets[self.target.key]
            fusion.pending.pop(self.target.key, None)
        if not fusion.targets:
            fusion.remove()
            _FUSIONS.pop(fusion.block, None)


def install_pair(block: nn.Module, component: Component) -> InstalledPair:
    """Set up the (add -> norm) pair of ``component`` in ``block`` (the module named by ``add_in``).

    The caller installs ``forward`` on the norm; pairs of one block share its hooks and mode.
    """
    v = component.variant
    norm = block.get_submodule(local_path(component.module, v.add_in))
    after = local_path(v.add_after, v.add_in)
    fusion = _FUSIONS.get(block)
    if fusion is None:
        fusion = _FUSIONS[block] = ResidualFusion(block)
    target = FusionTarget(
        norm, component.module, after, int(v.add_index), float(v.eps), float(v.offset), v.cast, v.weight
    )
    fusion.add(target)
    previous = norm.forward

    def forward(x, *args, **kwargs):
        out = fusion.norm_output(target, x)
        return out if out is not None else previous(x, *args, **kwargs)

    return InstalledPair(norm, forward, target, fusion)
