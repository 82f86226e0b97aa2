"""Training forwards whose token positions the model derives itself skip transformers' packed-sequence check.

Given no attention mask and no cache, transformers' causal-mask preparation looks for packed sequences in the
position ids (``masking_utils.find_packed_sequence_indices``) and reads the answer back to the host
(``.all()``): one device synchronisation at the start of every training forward, after which the device idles
until the host has issued the first blocks again (0.5-1 ms a step on an H200, ``benchmarks/results/e2e-h200.md``,
"largest gaps").  When the caller passes no position ids either, the model derives them as ``arange`` rows
from its cache position, so there is nothing packed to find: the check's answer is known without the read.
A caller's own position ids (a packed batch) or attention mask keep the check exactly as transformers runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from operators.global_swap import swap_global

# one entry per model forward in flight: True where that forward's positions are the model's own arange rows
_DERIVED: list[bool] = []
_CALLER_STATE = ("position_ids", "attention_mask", "past_key_values", "cache_position", "inputs_embeds")


def _skipping_when_derived(original: Callable[..., Any]) -> Callable[..., Any]:
    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if _DERIVED and _DERIVED[-1]:
            return None  # arange rows: one sequence per row, which is what None means
        return original(position_ids, *args, **kwargs)

    return find_packed_sequence_indices


def derived_positions_in_training(model: nn.Module) -> Callable[[], None]:
    """Skip the packed-sequence check for ``model``'s training forwards that pass only token ids (and labels);
    returns the undo.  A transformers without the check (or without ``masking_utils``) leaves nothing to do."""
    try:
        from transformers import masking_utils
    except ImportError:
        return lambda: None
    if not callable(getattr(masking_utils, "find_packed_sequence_indices", None)):
        return lambda: None
    lease = swap_global(vars(masking_utils), "find_packed_sequence_indices", _skipping_when_derived)

    def enter(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        only_ids = len(args) <= 1 and all(kwargs.get(name) is None for name in _CALLER_STATE)
        _DERIVED.append(module.training and only_ids)

    def leave(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if _DERIVED:
            _DERIVED.pop()

    before = model.register_forward_pre_hook(enter, with_kwargs=True)
    after = model.register_forward_hook(leave, with_kwargs=True, always_call=True)

    def undo() -> None:
        before.remove()
        after.remove()
        lease.release()

    return undo
