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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapt.core.errors import BadInput
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


def load_cluster_file(path: str | Path) -> Cluster:
    import yaml  # only cluster files need a YAML/TOML parser

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser, packaged
        import tomli as tomllib

    path = Path(path)
    if not path.is_file():
        raise BadInput(f"cluster file {path} does not exist")
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError) as err:
        raise BadInput(f"cluster file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {err}") from None
    if not isinstance(data, dict) or "gpu" not in data or "gpus" not in data:
        raise BadInput(f"cluster file {path} needs 'gpu' and 'gpus' keys")
    gpu = data["gpu"]
    if isinstance(gpu, dict):
        names = {f.name for f in dataclasses.fields(GpuType)}
        missing = sorted(n for n in names if n not in gpu and n != "pcie_gbps")
        if missing:
            raise BadInput(f"cluster file {path}: gpu mapping lacks {', '.join(missing)}")
        kind = GpuType(**{k: v for k, v in gpu.items() if k in names})
    else:
        kind = gpu_type(str(gpu))
    overrides = data.get("overrides") or {}
    unknown = set(overrides) - {f.name for f in dataclasses.fields(GpuType)}
    if unknown:
        raise BadInput(f"cluster file {path}: unknown override(s) {', '.join(sorted(unknown))}")
    kind = dataclasses.replace(kind, **overrides)
    try:
        num_gpus = int(data["gpus"])
        per_node = int(data.get("gpus_per_node") or kind.gpus_per_node)
    except (TypeError, ValueError):
        raise BadInput(f"cluster file {path}: 'gpus' and 'gpus_per_node' must be integers") from None
    return Cluster(dataclasses.replace(kind, gpus_per_node=per_node), num_gpus, min(per_node, num_gpus))


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


def local_cluster() -> Cluster:
    """Run the environment stage's measurements on this machine and plan for what it found."""
    from validators.environment import check_environment

    return cluster_from_environment(check_environment(measure=True).to_dict())
