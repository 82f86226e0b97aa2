"""A recognised component and the path arithmetic patches use: the leaf that providers and probes share, so they never
import the recognition package itself."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from torch import nn

from operators.inventory import json_ready
from operators.recognition.variants import Variant, check_variant, variant_from_dict


@dataclass
class Component:
    """One recognised piece of the model."""

    module: str
    kind: str  # one of KINDS, or "new"
    variant: Variant  # the kind's class in operators.recognition.variants.VARIANTS
    confirmed: bool = False  # True only after a numeric probe matched
    evidence: str = ""

    def __post_init__(self) -> None:
        check_variant(self.kind, self.variant, self.module)

    def to_dict(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json_ready({**fields, "variant": self.variant.to_dict()})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Component:
        """The component back from ``to_dict()``; its variant as ``variant_from_dict`` builds it."""
        variant = variant_from_dict(data["kind"], data.get("variant"), data["module"])
        return cls(**{**data, "variant": variant})


def local_path(path: str, base: str) -> str:
    """Recognition records absolute dotted paths; a patch resolves them below the module ``base`` it installs on."""
    if path == base:
        return ""
    if base and not path.startswith(base + "."):
        raise ValueError(f"{path} is not inside {base}")
    return path[len(base) + 1 :] if base else path


def inside(path: str, claimed: set[str], *, strict: bool) -> bool:
    """Is ``path`` below one of ``claimed`` (or, unless ``strict``, one of them): recognition skips what a component holds."""
    return any(path.startswith(c + ".") or (not strict and path == c) for c in claimed if c)


def dotted_attr(module: nn.Module, name: str) -> Any:
    """``module``'s attribute ``name``, through submodules when dotted (a router weight kept on a child
    projection, "layer.weight"); read on every call, so parameter swaps are seen."""
    return functools.reduce(getattr, name.split("."), module)
