"""The serialisation every variant shares: one JSON object per record, one key per field, and back.

``_Record`` turns a frozen dataclass into the object ``ops.json`` stores and builds it again, refusing keys
this version does not know; ``Variant`` is the base of every kind's variant (see the package docstring).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from adapt.core.errors import BadInput

_R = TypeVar("_R", bound="_Record")


@dataclass(frozen=True, kw_only=True)
class _Record:
    """Fields that serialise to a JSON object and back; ``metadata["key"]`` renames a field's key,
    ``metadata["load"]`` rebuilds a nested record."""

    def to_dict(self) -> dict[str, Any]:
        return {_key(f): _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls: type[_R], data: Mapping[str, Any], where: str = "") -> _R:
        by_key = {_key(f): f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(by_key))
        if unknown:
            raise BadInput(
                f"{where or cls.__name__}: fields this version of adapt does not know: {', '.join(unknown)} "
                "(written by another version? rerun the operators stage, e.g. adapt run --force)"
            )
        values = {}
        for key, value in data.items():
            f = by_key[key]
            load = f.metadata.get("load")
            values[f.name] = load(value, f"{where}.{key}") if load and value is not None else _tupled(value)
        return cls(**values)


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _plain(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _tupled(value: Any) -> Any:
    """JSON lists back as tuples: a frozen variant holds no mutable containers."""
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True, kw_only=True)
class Variant(_Record):
    """Base of every kind's variant."""
