"""Reference-counted swaps of a module-level name: several patched modules and models share one modelling module's
globals (the rotary rotation function), so the original comes back only when the last user releases it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class _GlobalSwap:
    scope: dict[str, Any]
    name: str
    original: Any
    replacement: Any
    users: int = 0


@dataclass
class GlobalLease:
    """One user's hold on a swapped module-level name; ``release()`` is idempotent."""

    original: Any
    swap: _GlobalSwap
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        swap = self.swap
        swap.users -= 1
        if swap.users == 0:
            if swap.scope.get(swap.name) is swap.replacement:
                swap.scope[swap.name] = swap.original
            _SWAPS.pop((id(swap.scope), swap.name), None)


_SWAPS: dict[tuple[int, str], _GlobalSwap] = {}


def swap_global(scope: dict[str, Any], name: str, make_replacement: Callable[[Any], Any]) -> GlobalLease:
    """Replace ``scope[name]`` by ``make_replacement(original)``, once per scope and name, for as long
    as any lease is held: several modules and models share a modelling module's globals."""
    key = (id(scope), name)
    swap = _SWAPS.get(key)
    if swap is None:
        original = scope[name]
        swap = _SWAPS[key] = _GlobalSwap(scope, name, original, make_replacement(original))
        scope[name] = swap.replacement
    swap.users += 1
    return GlobalLease(swap.original, swap)
