"""Backend profiles: a declarative statement of what a target accelerator can execute.

A profile is YAML with ``aten`` and ``onnx`` rule lists.  Each ATen rule names overloads by
glob (``aten.mm.default``, ``aten.*``) with the dtypes it supports; each ONNX rule names op types
with an opset range and dtypes; ``exclude`` rules carve exceptions out of a glob.  ``codegen``
says what Inductor can emit for the device (``triton``, ``cpp`` or ``none``), which decides whether
the ``generated`` path exists there.  Shipped: ``cuda-hopper`` and ``npu-restricted``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from adapt.core.errors import BadInput
from adapt.core.inputs import read_input_text

PROFILE_DIR = Path(__file__).parent


@dataclass
class OpRule:
    pattern: str
    dtypes: list[str] = field(default_factory=list)  # empty: any dtype
    opset: tuple[int, int] | None = None  # ONNX rules only


@dataclass
class BackendProfile:
    name: str
    device: str
    codegen: str  # "triton" | "cpp" | "none"
    compute_capability: str | None = None
    description: str = ""
    aten: list[OpRule] = field(default_factory=list)
    aten_exclude: list[str] = field(default_factory=list)
    onnx: list[OpRule] = field(default_factory=list)

    def supports_aten(self, overload: str, dtypes: list[str] | None = None) -> bool:
        if any(fnmatch.fnmatchcase(overload, pat) for pat in self.aten_exclude):
            return False
        for rule in self.aten:
            if fnmatch.fnmatchcase(overload, rule.pattern):
                return not rule.dtypes or not dtypes or all(d in rule.dtypes for d in dtypes)
        return False

    def supports_onnx(self, op_type: str, opset: int | None) -> bool:
        for rule in self.onnx:
            if fnmatch.fnmatchcase(op_type, rule.pattern):
                return rule.opset is None or opset is None or rule.opset[0] <= opset <= rule.opset[1]
        return False

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": self.device,
            "codegen": self.codegen,
            "compute_capability": self.compute_capability,
        }


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | None) -> BackendProfile:
    """A shipped profile by name, or a YAML file by path; ``None`` is ``cuda-hopper``."""
    path = (
        Path(name_or_path)
        if name_or_path and Path(name_or_path).suffix in (".yaml", ".yml")
        else PROFILE_DIR / f"{name_or_path or 'cuda-hopper'}.yaml"
    )
    if not path.is_file():
        raise BadInput(
            f"unknown profile {name_or_path!r}: use one of {', '.join(available_profiles())} or a .yaml file"
        )
    try:
        data = yaml.safe_load(read_input_text(path, "profile"))
        return _parse(data)
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as err:
        raise BadInput(f"profile {path}: {err}") from None


def _parse(data: dict[str, Any]) -> BackendProfile:
    def rules(entries: list[Any]) -> list[OpRule]:
        out = []
        for entry in entries or []:
            if isinstance(entry, str):
                out.append(OpRule(entry))
                continue
            opset = entry.get("opset")
            out.append(OpRule(entry["op"], list(entry.get("dtypes", [])), tuple(opset) if opset else None))
        return out

    aten = data.get("aten", {})
    return BackendProfile(
        name=str(data["name"]),
        device=str(data["device"]),
        codegen=str(data.get("codegen", "none")),
        compute_capability=data.get("compute_capability"),
        description=str(data.get("description", "")),
        aten=rules(aten.get("include", [])),
        aten_exclude=list(aten.get("exclude", [])),
        onnx=rules(data.get("onnx", [])),
    )
