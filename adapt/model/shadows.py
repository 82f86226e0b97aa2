"""Values beside a meta forward: the tensors it computes without weights (token ids, positions, masks) are
computed a second time on the CPU, so what they hold can be read.

A skeleton on the meta device has no numbers, yet its attention mask does not depend on the weights: it is
built from the token ids and the positions.  Whether the model attends causally is then a fact read from
the mask it really builds, not from a class name or a config flag.  The same values answer ``.item()`` on
such tensors (a padding check on the ids, a position read back), which meta tensors otherwise refuse.

Where the attention scores are formed, the caller puts a *stand-in* value of zeros beside them: every op
applied to the scores before the softmax (scaling, soft-capping, adding or filling a mask) is then run on
the stand-in too, and what arrives at the softmax is the mask alone.  Stand-ins never answer ``.item()``:
they are not the scores' values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

_MAX_ELEMENTS = 1 << 20  # a weight-free tensor this large is no mask at probe sizes; it is not copied
_BLOCKED = -1e4  # an additive mask blocks with -inf, the dtype's minimum, or BERT's -10000


class Shadows:
    """CPU values of meta tensors computed without weights, and stand-ins for the attention scores."""

    def __init__(self) -> None:
        self._values = WeakTensorKeyDictionary()  # tensor -> (cpu value, is a stand-in)

    def set(self, tensor: torch.Tensor, value: torch.Tensor, stand_in: bool = False) -> None:
        self._values[tensor] = (value.detach().cpu(), stand_in)

    def stand_in_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        entry = self._values.get(tensor)
        return entry[0] if entry is not None and entry[1] else None

    def _known(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
        entry = self._values.get(tensor)
        if entry is not None:
            return entry
        return None if tensor.is_meta else (tensor.detach().cpu(), False)

    def value_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The tensor's value (its own for a real tensor), None for a weight-derived meta tensor."""
        known = self._known(tensor)
        return known[0] if known is not None else None

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func``'s result; beside it, the CPU values of its outputs when every input tensor has one."""
        flat, spec = tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        known = [self._known(t) for t in tensors]
        stand_in = any(k is not None and k[1] for k in known)
        on_meta = any(t.is_meta for t in tensors) or any(
            x == torch.device("meta") for x in flat if isinstance(x, torch.device)
        )
        computable = (on_meta or stand_in) and all(k is not None for k in known)
        try:
            out = func(*args, **kwargs)
        except Exception:
            if not computable and on_meta and not stand_in and any(not t.is_meta for t in tensors):
                # Weight-derived meta data beside a real buffer (a router's biases, computed at construction like
                # every buffer of the skeleton): where a loaded model holds both on one device, so does this op.
                return self._on_meta(func, flat, spec, args, kwargs)
            # A data-dependent op (``.item()``, ``nonzero``) on meta tensors whose values are known.
            if not computable or stand_in:
                raise
            value = self._on_cpu(func, flat, spec)
            out = _like_on_meta(value)
            self._pair(out, value, False)
            return out
        if computable and _elements(out) <= _MAX_ELEMENTS:
            try:
                self._pair(out, self._on_cpu(func, flat, spec), stand_in)
                return out
            except Exception:  # noqa: BLE001 - an op the CPU will not run here leaves its outputs without values
                pass
        self._forget_written(func, args, kwargs)
        return out

    def _on_meta(self, func: Any, flat: list, spec: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` with every real tensor moved to the meta device; its outputs have no values."""
        moved = [x.to("meta") if isinstance(x, torch.Tensor) and not x.is_meta else x for x in flat]
        on_meta_args, on_meta_kwargs = tree_unflatten(moved, spec)
        out = func(*on_meta_args, **on_meta_kwargs)
        self._forget_written(func, args, kwargs)
        return out

    def _on_cpu(self, func: Any, flat: list, spec: Any) -> Any:
        cpu = torch.device("cpu")
        moved = [
            self.value_of(x) if isinstance(x, torch.Tensor) else cpu if isinstance(x, torch.device) else x for x in flat
        ]
        args, kwargs = tree_unflatten(moved, spec)
        return func(*args, **kwargs)

    def _pair(self, out: Any, value: Any, stand_in: bool) -> None:
        outs, values = tree_flatten(out)[0], tree_flatten(value)[0]
        for o, v in zip(outs, values):
            if isinstance(o, torch.Tensor) and isinstance(v, torch.Tensor) and (o.is_meta or stand_in):
                self._values[o] = (v, stand_in)

    def _forget_written(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An op that wrote into a tensor without its value being computed leaves that tensor's value stale."""
        schema = getattr(func, "_schema", None)
        if schema is None:
            return
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            target = args[index] if index < len(args) else kwargs.get(argument.name)
            if isinstance(target, torch.Tensor):
                self._values.pop(target, None)


def _elements(out: Any) -> int:
    return sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


def _like_on_meta(value: Any) -> Any:
    flat, spec = tree_flatten(value)
    return tree_unflatten(
        [torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v for v in flat], spec
    )


def blocks_future(mask: torch.Tensor, queries: int, keys: int) -> bool:
    """Whether a mask over [..., queries, keys] blocks every later key from every query: causal attention.

    A boolean mask keeps where True (SDPA's convention); a float mask is added to the scores and blocks
    with a large negative value."""
    blocked = ~mask if mask.dtype == torch.bool else mask.double() <= _BLOCKED
    blocked = blocked.expand(*blocked.shape[:-2], queries, keys)
    later = torch.ones(queries, keys, dtype=torch.bool).triu(1 + keys - queries)
    return bool(blocked[..., later].all()) and bool(later.any())
