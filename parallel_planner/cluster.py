"""The cluster a plan targets: a catalogue GPU type and a GPU count, from flags, a file or this machine
(as the environment stage measures it: memory, GEMM ceiling, copy and all-reduce bandwidth).

Cluster file (YAML or TOML), for example::

    gpu: h100              # a catalogue name ...
    gpus: 1024
    gpus_per_node: 8       # optional, defaults to the GPU type's node size
    overrides:             # optional: measured figures replacing catalogue ones
      inter_node_gbps: 25

or ``gpu:`` as a mapping with every ``GpuType`` field, for hardware the catalogue does not know.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapt.core.errors import BadInput
from adapt.core.inputs import read_input_text
from parallel_planner.catalog import GIB, GPU_CATALOG, GpuType, gpu_type


@dataclass(frozen=True)
class Cluster:
    gpu: GpuType
    num_gpus: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise BadInput(f"--gpus must be at least 1, got {self.num_gpus}")
        if self.gpus_per_node < 1:
            raise BadInput(f"--gpus-per-node must be at least 1, got {self.gpus_per_node}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise BadInput(f"{self.num_gpus} GPUs do not fill whole nodes of {self.gpus_per_node}")

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu.to_dict(), "num_gpus": self.num_gpus, "gpus_per_node": self.gpus_per_node}


def make_cluster(gpu: str, num_gpus: int, gpus_per_node: int | None = None) -> Cluster:
    kind = gpu_type(gpu)
    per_node = gpus_per_node or min(kind.gpus_per_node, num_gpus)
    return Cluster(dataclasses.replace(kind, gpus_per_node=per_node), num_gpus, per_node)


# Each GpuType field: the check a cluster file's value must pass, and how the message states it.
_POSITIVE = "a number > 0"
_FIELD_RULES: dict[str, str] = {
    "memory_gib": _POSITIVE,
    "bf16_tflops": _POSITIVE,
    "fp8_tflops": "a number >= 0 (0: no fp8 tensor cores)",
    "hbm_gbps": _POSITIVE,
    "intra_node_gbps": _POSITIVE,
    "inter_node_gbps": _POSITIVE,
    "gpus_per_node": "an integer >= 1",
    "gemm_ceiling": "a number in (0, 1]",
    "pcie_gbps": _POSITIVE,
}
_TOP_LEVEL_KEYS = ("gpu", "gpus", "gpus_per_node", "overrides")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field_ok(name: str, value: Any) -> bool:
    if name == "gpus_per_node":
        return _is_whole(value) and value >= 1
    if not _is_number(value):
        return False
    if name == "fp8_tflops":
        return value >= 0
    if name == "gemm_ceiling":
        return 0 < value <= 1
    return value > 0


def _check_fields(where: str, values: dict[str, Any]) -> None:
    for name, value in values.items():
        rule = _FIELD_RULES.get(name)
        if rule is None:
            if name == "name" and isinstance(value, str) and value.strip():
                continue
            allowed = "a non-empty string" if name == "name" else f"one of {', '.join(('name', *_FIELD_RULES))}"
            raise BadInput(f"{where}.{name} is {value!r}; allowed: {allowed}")
        if not _field_ok(name, value):
            raise BadInput(f"{where}.{name} is {value!r}; allowed: {rule}")


def load_cluster_file(path: str | Path) -> Cluster:
    """A cluster YAML/TOML file, every value checked: one line naming the field, its value and what is allowed."""
    import yaml  # only cluster files need a YAML/TOML parser

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser, packaged
        import tomli as tomllib

    path = Path(path)
    if not path.is_file():
        raise BadInput(f"cluster file {path} does not exist")
    try:
        text = read_input_text(path, "cluster file")
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise BadInput(f"cluster file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {first}") from None
    if not isinstance(data, dict) or "gpu" not in data or "gpus" not in data:
        raise BadInput(f"cluster file {path} needs 'gpu' and 'gpus' keys")
    unknown = sorted(str(k) for k in data if k not in _TOP_LEVEL_KEYS)
    if unknown:
        raise BadInput(f"cluster file {path}: unknown key {unknown[0]!r}; allowed: {', '.join(_TOP_LEVEL_KEYS)}")
    where = f"cluster file {path}:"
    gpu = data["gpu"]
    if isinstance(gpu, dict):
        names = {f.name for f in dataclasses.fields(GpuType)}
        missing = sorted(n for n in names if n not in gpu and n != "pcie_gbps")
        if missing:
            raise BadInput(f"{where} gpu mapping lacks {', '.join(missing)}")
        _check_fields(f"{where} gpu", gpu)
        kind = GpuType(**gpu)
    elif isinstance(gpu, str):
        kind = gpu_type(gpu)
    else:
        raise BadInput(f"{where} gpu is {gpu!r}; allowed: a catalogue name ({', '.join(GPU_CATALOG)}) or a mapping")
    overrides = data.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise BadInput(f"{where} overrides is {overrides!r}; allowed: a mapping of GPU fields to numbers")
    _check_fields(f"{where} overrides", {k: v for k, v in overrides.items()})
    kind = dataclasses.replace(kind, **overrides)
    num_gpus = data["gpus"]
    if not _is_whole(num_gpus) or num_gpus < 1:
        raise BadInput(f"{where} gpus is {num_gpus!r}; allowed: an integer >= 1")
    per_node = data.get("gpus_per_node", kind.gpus_per_node)
    if not _is_whole(per_node) or per_node < 1:
        raise BadInput(f"{where} gpus_per_node is {per_node!r}; allowed: an integer >= 1")
    return Cluster(dataclasses.replace(kind, gpus_per_node=per_node), num_gpus, min(per_node, num_gpus))


_CLUSTER_SPEC = re.compile(r"^\s*(-?\d+)\s*[x×*]\s*([A-Za-z0-9_.\-]+)\s*$")
LOCAL = "local"


def parse_cluster_option(text: str, flag: str = "--cluster") -> Cluster | None:
    """``<N>x<GPU>`` (a catalogue GPU), a cluster YAML/TOML file, or ``local`` (None: measured when work starts).

    The one parser of ``--cluster`` for every command, so a bad value fails before any stage runs.
    """
    if text.strip().lower() == LOCAL:
        return None
    match = _CLUSTER_SPEC.match(text)
    if match:
        count = int(match.group(1))
        if count < 1:
            raise BadInput(f"{flag} {text!r}: GPU count {count}; allowed: an integer >= 1, as in 8xH100")
        try:
            gpu_type(match.group(2))
        except BadInput:
            raise BadInput(
                f"{flag} {text!r}: GPU type {match.group(2)!r} is not in the catalogue; allowed: {', '.join(GPU_CATALOG)}"
            ) from None
        return make_cluster(match.group(2), count)
    if Path(text).is_file():
        return load_cluster_file(text)
    raise BadInput(f"{flag} {text!r}: allowed: <N>x<GPU> (e.g. 8xH100), a cluster YAML/TOML file, or 'local'")


def cluster_from_environment(report: dict[str, Any]) -> Cluster:
    """This machine as the environment stage measured it (``validators.environment.EnvReport.to_dict()``).

    Peaks and network figures come from the catalogue entry the device name matches; memory, the
    achieved GEMM ceiling, HBM bandwidth (measured copy) and NCCL bus bandwidth replace catalogue figures.
    """
    devices = report.get("devices") or []
    if report.get("device_type") != "cuda" or not devices:
        raise BadInput("this machine has no GPU to plan for; pass --gpu TYPE --gpus N instead")
    name = str(devices[0]["name"]).lower().replace(" ", "")
    matches = [gpu for key, gpu in GPU_CATALOG.items() if key in name]
    if not matches:
        raise BadInput(f"local GPU {devices[0]['name']!r} is not in the catalogue; describe it in a cluster file")
    kind = matches[0]
    measured: dict[str, Any] = {"memory_gib": devices[0]["memory_bytes"] / GIB, "gpus_per_node": len(devices)}
    if report.get("matmul_tflops") and report.get("matmul_dtype") == "bfloat16":
        measured["gemm_ceiling"] = min(1.0, report["matmul_tflops"] / kind.bf16_tflops)
    if report.get("copy_gbps"):
        measured["hbm_gbps"] = report["copy_gbps"]
    if report.get("allreduce_gbps"):
        measured["intra_node_gbps"] = report["allreduce_gbps"]
    return Cluster(dataclasses.replace(kind, **measured), len(devices), len(devices))
