"""Decomposition of ops a profile lacks into ops it has, through PyTorch's own ``torch._decomp`` tables.

The op's recorded example call (meta tensors) is re-traced with ``make_fx`` under the core-ATen
decomposition table; the decomposition is accepted only if every op in the resulting graph is
supported by the profile (one extra round of decomposition is allowed for nested composites).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch._decomp import core_aten_decompositions, decomposition_table
from torch.fx.experimental.proxy_tensor import make_fx

from operators.dispatch_trace import example_call
from operators.profiles import BackendProfile

_IGNORED = {"output", "placeholder", "get_attr"}


@dataclass
class Decomposition:
    overload: str
    ok: bool
    into: list[str] = field(default_factory=list)  # overloads the decomposition produces
    missing: list[str] = field(default_factory=list)  # of those, the ones the profile still lacks
    reason: str = ""


def _table(func) -> dict:
    """Core-ATen decompositions (they target core ATen, not prims), plus ``func``'s own entry if only
    the full table has one."""
    table = dict(core_aten_decompositions())
    if func not in table and func in decomposition_table:
        table[func] = decomposition_table[func]
    return table


def decompose(overload: str, profile: BackendProfile, dtypes: list[str]) -> Decomposition:
    call = example_call(overload)
    if call is None:
        return Decomposition(overload, False, reason="no example call recorded")
    func, args, kwargs = call
    table = _table(func)
    if func not in table:
        return Decomposition(overload, False, reason="torch._decomp has no decomposition")
    try:
        graph = make_fx(lambda *a: func(*a, **kwargs), decomposition_table=table, tracing_mode="real")(*args)
    except Exception as err:  # a decomposition that cannot be traced is not usable
        return Decomposition(overload, False, reason=f"decomposition failed to trace: {type(err).__name__}")
    into = sorted(
        {str(n.target) for n in graph.graph.nodes if n.op == "call_function" and hasattr(n.target, "_schema")}
    )
    missing = [op for op in into if not profile.supports_aten(op, dtypes)]
    return Decomposition(overload, not missing, into, missing, "" if not missing else "decomposes into unsupported ops")
