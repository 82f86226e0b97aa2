"""The options tree's machinery: dataclass groups whose fields carry their own flag, help and default.

A group is a dataclass deriving from ``OptionGroup``; each of its fields is declared with ``option``, which
puts the flag, its help, choices, lower bound and old spellings in the field's metadata.  ``add_options``
turns a group's fields into argparse arguments and ``build`` turns a parsed namespace (or any mapping of
field names) back into the group, or into a dataclass holding groups.  A field's name is its argparse
``dest``, its key in the stage cache and in report.json, so names are unique across the tree.

Every command that takes a quantity adds it from the group that owns it: the flag, its default and help are
written once, here, and cannot differ between commands.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from adapt.core.errors import BadInput

_FLAG = "adapt.flag"


@dataclass(frozen=True)
class Flag:
    """How one option field appears on the command line."""

    help: str
    flag: str | None  # "--seq-len"; None: a positional argument
    old: tuple[str, ...] = ()  # old spellings: still parsed, hidden from --help
    type: Callable[[str], Any] | None = None  # None: a string, or a switch for a bool
    choices: tuple[str, ...] | None = None
    minimum: int | None = None
    metavar: str | None = None


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: str = "",
    positional: bool = False,
    old: tuple[str, ...] = (),
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    minimum: int | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field that is also a flag (``--field-name`` unless ``flag`` says otherwise)."""
    spec = Flag(help, None if positional else flag, old, type, choices, minimum, metavar)
    metadata = {_FLAG: spec}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class OptionGroup:
    """A group of options: its values are checked against their choices and bounds when it is built."""

    def __post_init__(self) -> None:
        for field in option_fields(type(self)):
            spec, value = flag_spec(field), getattr(self, field.name)
            if value is None or isinstance(value, bool):
                continue
            if spec.choices is not None and value not in spec.choices:
                raise BadInput(f"{flag_name(field)} is {value!r}; allowed: {', '.join(spec.choices)}")
            if spec.minimum is not None and value < spec.minimum:
                raise BadInput(f"{flag_name(field)} is {value}; allowed: an integer >= {spec.minimum}")


def flag_spec(field: dataclasses.Field) -> Flag:
    return field.metadata[_FLAG]


def flag_name(field: dataclasses.Field) -> str:
    """The flag a field is given under (``--seq-len``), or its name when it is positional."""
    spec = flag_spec(field)
    if spec.flag is None:
        return field.name
    return spec.flag or "--" + field.name.replace("_", "-")


def default_of(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def option_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if _FLAG in f.metadata]


def groups(cls: type) -> Iterator[tuple[str, type]]:
    """``(attribute, group class)`` for each group a tree (a dataclass holding groups) holds."""
    for field in dataclasses.fields(cls):
        if _group_type(field) is not None:
            yield field.name, _group_type(field)


def _group_type(field: dataclasses.Field) -> type | None:
    factory = field.metadata.get("group")
    return factory if isinstance(factory, type) else None


def group(cls: type, required: bool = False) -> Any:
    """A tree's field holding one group (``plan: PlanOptions = group(PlanOptions)``); a required one has
    a field without default (a positional argument) and no default of its own."""
    if required:
        return dataclasses.field(metadata={"group": cls})
    return dataclasses.field(default_factory=cls, metadata={"group": cls})


def argument_keywords(field: dataclasses.Field) -> dict[str, Any]:
    """How a field's value is read from a command line (a switch, or its type, choices and metavar): one answer
    for every command and for the pytest plugin, whose options are the same fields."""
    spec, kwargs = flag_spec(field), {}
    if field.type in ("bool", bool):
        kwargs["action"] = "store_true"
    elif spec.type is not None:
        kwargs["type"] = spec.type
    if spec.choices is not None:
        kwargs["choices"] = spec.choices
    if spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    elif spec.flag is not None and "action" not in kwargs and spec.choices is None:  # --global-batch GLOBAL_BATCH
        kwargs["metavar"] = flag_name(field).lstrip("-").replace("-", "_").upper()
    return kwargs


def add_options(
    parser: argparse.ArgumentParser | argparse._ActionsContainer,
    cls: type,
    only: tuple[str, ...] | None = None,
    old: Mapping[str, tuple[str, ...]] | None = None,
) -> None:
    """Add the flags of group ``cls`` (or of the fields named in ``only``) to ``parser``.

    ``old`` adds a command's own old spellings of a field (``adapt plan --seq``), hidden like the group's.
    """
    fields = option_fields(cls)
    unknown = set(only or ()) - {f.name for f in fields}
    if unknown:
        raise ValueError(f"{cls.__name__} has no option {', '.join(sorted(unknown))}")
    for field in fields:
        if only is not None and field.name not in only:
            continue
        spec, kwargs = flag_spec(field), argument_keywords(field)
        if spec.flag is None:
            parser.add_argument(field.name, help=spec.help, **kwargs)
            continue
        parser.add_argument(flag_name(field), dest=field.name, default=default_of(field), help=spec.help, **kwargs)
        for spelling in (*spec.old, *(old or {}).get(field.name, ())):
            parser.add_argument(spelling, dest=field.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def build(cls: type, values: Mapping[str, Any] | argparse.Namespace) -> Any:
    """``cls`` from field names to values (a parsed namespace, or report.json's flat options).

    A tree's groups are built from the same values; names a class does not have are ignored, and fields
    with no value keep their defaults.
    """
    if isinstance(values, argparse.Namespace):
        values = vars(values)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if _group_type(field) is not None:
            kwargs[field.name] = build(_group_type(field), values)
        elif field.name in values:
            kwargs[field.name] = values[field.name]
    return cls(**kwargs)


def flatten(obj: Any) -> dict[str, Any]:
    """Field names to values over a tree and its groups: the inverse of ``build``."""
    flat: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if _group_type(field) is not None:
            flat.update(flatten(value))
        else:
            flat[field.name] = list(value) if isinstance(value, (list, tuple)) else value
    return flat


def replace_flat(obj: Any, **values: Any) -> Any:
    """A copy of ``obj`` (a tree or a group) with the named fields, wherever they live, set to ``values``."""
    return build(type(obj), {**flatten(obj), **values})
