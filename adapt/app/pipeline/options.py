"""Options of one ``adapt run``: what the user chose, and the defaults the validation device chose.

Every option the device sizes (dtype, validation shapes, step counts, the plan's target cluster)
is ``None`` until ``RunOptions.with_device_defaults`` fills it from ``choose_defaults``: the one place that
decides how big a run this machine should attempt.  A CPU runs tiny shapes so that a small model
finishes in seconds; a GPU runs the shapes a user trains at, on the machine it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from adapt.core.errors import BadInput

# Order matters: each stage may read the typed results of the stages before it.
STAGE_NAMES: tuple[str, ...] = (
    "intake",
    "operators",
    "plan",
    "environment",
    "alignment",
    "generation",
    "throughput",
    "replan",
    "soak",
)
REPORT_STAGE = "report"  # always runs last; listed in --stages/--skip for completeness
DTYPES = ("fp32", "bf16", "fp16")
LOCAL_CLUSTER = "local"  # ``--cluster local``: plan for this machine, as the environment stage measures it

CUDA_SEQ_CAP = 2048  # a training-sized sequence that every model with 2k+ positions can take
CPU_SEQ = 32
CPU_CLUSTER = "8xH100"  # a CPU is never the training target: plan for a common GPU node


@dataclass(frozen=True)
class DeviceDescription:
    """The validation device, as far as the defaults depend on it."""

    kind: str  # "cpu" or "cuda"
    name: str = "cpu"  # the GPU's name on CUDA
    count: int = 0  # GPUs visible to this process
    memory_bytes: int = 0  # of the GPU validation runs on

    @classmethod
    def of(cls, device: str) -> DeviceDescription:
        """Describe ``--device`` on this machine; asking for a GPU that is not there is bad input."""
        if device == "cpu":
            return cls("cpu")
        import torch

        if not torch.cuda.is_available():
            raise BadInput(f"--device {device} requested but no CUDA device is available")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise BadInput(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        props = torch.cuda.get_device_properties(index)
        return cls("cuda", props.name, torch.cuda.device_count(), props.total_memory)

    def label(self) -> str:
        if self.kind == "cpu":
            return "cpu"
        return f"{self.count}x {self.name} ({self.memory_bytes / 2**30:.0f} GiB)"


@dataclass(frozen=True)
class DeviceDefaults:
    """What a run on one device does when the user names nothing else."""

    dtype: str
    seq_len: int
    batch_size: int
    bench_steps: int
    soak_steps: int
    ckpt_every: int
    cluster: str


def choose_defaults(device: DeviceDescription, max_positions: int | None) -> DeviceDefaults:
    """The device's defaults; the sequence never exceeds what the model's positions allow."""
    if device.kind == "cuda":
        seq = min(max_positions or CUDA_SEQ_CAP, CUDA_SEQ_CAP)
        return DeviceDefaults("bf16", seq, 2, 20, 40, 10, LOCAL_CLUSTER)
    return DeviceDefaults("fp32", min(max_positions or CPU_SEQ, CPU_SEQ), 2, 3, 12, 4, CPU_CLUSTER)


def max_positions(config: dict[str, Any]) -> int | None:
    """The longest sequence a checkpoint's config allows (a multimodal model's text config counts)."""
    for section in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def defaults_help() -> str:
    """How the device chooses the defaults, for ``adapt run --help`` (read from ``choose_defaults`` itself)."""

    def line(kind: str, d: DeviceDefaults, cluster_note: str) -> str:
        return (
            f"{kind}: {d.dtype}, batch {d.batch_size} x seq min(max positions, {d.seq_len}), throughput "
            f"{d.bench_steps} steps, soak {d.soak_steps} steps (checkpoint every {d.ckpt_every}), "
            f"plan for --cluster {d.cluster}{cluster_note}."
        )

    cpu = choose_defaults(DeviceDescription("cpu"), None)
    cuda = choose_defaults(DeviceDescription("cuda", "GPU", 1), None)
    return " ".join(
        (
            "Defaults chosen by --device (an option given explicitly wins).",
            line("cpu", cpu, ""),
            line("cuda", cuda, " (this machine: its GPUs, their count, measured matmul rate and memory bandwidth)"),
            "The report header states the values the device chose.",
        )
    )


DEVICE_CHOSEN = tuple(f.name for f in dataclasses.fields(DeviceDefaults))


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
    # plan: the cluster the model will be laid out on and the workload
    cluster: str | None = None  # "<N>x<GPU>" from the catalogue, a cluster YAML/TOML file, or "local"
    plan_seq_len: int = 4096
    plan_global_batch: int = 64
    precision: str = "bf16"  # training precision the plan and environment check assume
    # validation on this machine; None: chosen by the device (``choose_defaults``)
    device: str = "cpu"
    dtype: str | None = None  # candidate dtype for alignment/throughput/soak
    seq_len: int | None = None
    batch_size: int | None = None
    bench_steps: int | None = None
    soak_steps: int | None = None
    ckpt_every: int | None = None
    thresholds: str | None = None  # alignment thresholds file passed to the validators
    # filled by ``with_device_defaults``: the machine the run validates on and which options its device chose
    machine: str | None = None
    device_chosen: tuple[str, ...] = ()

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
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BadInput(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    def with_device_defaults(self, device: DeviceDescription, positions: int | None) -> RunOptions:
        """These options with every unset device-sized option filled from ``choose_defaults``."""
        defaults = choose_defaults(device, positions)
        chosen = tuple(name for name in DEVICE_CHOSEN if getattr(self, name) is None)
        filled = {name: getattr(defaults, name) for name in chosen}
        return dataclasses.replace(self, **filled, machine=device.label(), device_chosen=chosen)

    def subset(self, keys: tuple[str, ...]) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {k: data[k] for k in keys}

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["device_chosen"] = list(self.device_chosen)
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
