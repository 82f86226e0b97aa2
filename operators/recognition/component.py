"""A recognised component and the path arithmetic patches use: the leaf that providers and probes share, so they never
import the recognition package itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from operators.inventory import json_ready


@dataclass
class Component:
    """One recognised piece of the model."""

    module: str
    kind: str  # one of KINDS, or "new"
    variant: dict[str, Any] = field(default_factory=dict)
    confirmed: bool = False  # True only after a numeric probe matched
    evidence: str = ""

    def to_dict(self) -> dict[str, Any]:
        return json_ready(dataclasses.asdict(self))


def local_path(path: str, base: str) -> str:
    """Recognition records absolute dotted paths; a patch resolves them below the module ``base`` it installs on."""
    if path == base:
        return ""
    if base and not path.startswith(base + "."):
        raise ValueError(f"{path} is not inside {base}")
    return path[len(base) + 1 :] if base else path
