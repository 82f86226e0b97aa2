"""Options of one ``adapt run``: what the user chose, with CPU-sized defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from adapt.errors import BadInput

# Order matters: each stage may read the typed results of the stages before it.
STAGE_NAMES: tuple[str, ...] = (
    "intake", "operators", "plan", "environment", "alignment", "generation", "throughput", "soak"
)
REPORT_STAGE = "report"  # always runs last; listed in --stages/--skip for completeness
DTYPES = ("fp32", "bf16", "fp16")


@dataclass
class RunOptions:
    """Everything that shapes a run.  Fields named in a stage's ``option_keys`` are part of its cache key."""

    source: str
    out_dir: str
    stages: list[str] = field(default_factory=lambda: list(STAGE_NAMES))
    force: bool = False
    trust_remote_code: bool = False
    allow_pickle: bool = False
    # operators
    profile: str | None = None  # backend profile name or file (None: the operators' default for the device)
    # plan: the cluster the model will be laid out on (not this machine) and the workload
    cluster: str = "8xH100"  # "<N>x<GPU>" from the planner's catalogue, or a cluster YAML/TOML file
    plan_seq_len: int = 4096
    plan_global_batch: int = 64
    precision: str = "bf16"  # training precision the plan and environment check assume
    # validation on this machine: small shapes so a tiny model finishes in seconds on a CPU
    device: str = "cpu"
    dtype: str | None = None  # candidate dtype for alignment/throughput; None: bf16 on cuda, fp32 on cpu
    seq_len: int = 32
    batch_size: int = 2
    bench_steps: int = 3
    soak_steps: int = 12
    ckpt_every: int = 4
    thresholds: str | None = None  # alignment thresholds file passed to the validators

    def __post_init__(self) -> None:
        unknown = [s for s in self.stages if s not in STAGE_NAMES]
        if unknown:
            raise BadInput(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGE_NAMES)}")
        self.stages = [s for s in STAGE_NAMES if s in self.stages]
        if self.dtype is not None and self.dtype not in DTYPES:
            raise BadInput(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise BadInput(f"--device must be cpu or cuda[:N], got {self.device!r}")
        for name in (
            "seq_len",
            "batch_size",
            "bench_steps",
            "soak_steps",
            "ckpt_every",
            "plan_seq_len",
            "plan_global_batch",
        ):
            if getattr(self, name) < 1:
                raise BadInput(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    @property
    def candidate_dtype(self) -> str:
        if self.dtype:
            return self.dtype
        return "fp32" if self.device == "cpu" else "bf16"

    def subset(self, keys: tuple[str, ...]) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        out = {k: data[k] for k in keys}
        if "dtype" in keys:
            out["dtype"] = self.candidate_dtype
        return out

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["dtype"] = self.candidate_dtype
        return data


def select_stages(only: list[str] | None, skip: list[str] | None) -> list[str]:
    """``--stages`` and ``--skip`` (comma lists) to the ordered list of stages to run."""
    only = [s for s in (only or []) if s != REPORT_STAGE]
    skip = [s for s in (skip or []) if s != REPORT_STAGE]
    for name in [*only, *skip]:
        if name not in STAGE_NAMES:
            raise BadInput(f"unknown stage {name!r}; choose from {', '.join((*STAGE_NAMES, REPORT_STAGE))}")
    chosen = only or list(STAGE_NAMES)
    selected = [s for s in STAGE_NAMES if s in chosen and s not in skip]
    if not selected:
        raise BadInput("--stages/--skip leave no stage to run")
    return selected
