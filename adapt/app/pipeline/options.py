"""The options tree of ``adapt``: what the user chose, and the defaults the validation device chose.

``RunOptions`` holds one group per concern (model, run, operators, plan, validation); each field of a group
carries its flag, help and default (``adapt.app.options.option``), and every command that takes a quantity
adds its flag from the group that owns it.  A field's name is also its key in report.json and in the
stage cache (``RunOptions.to_dict``/``subset``).

Every option the device sizes (dtype, validation shapes, step counts, the plan's target cluster)
is ``None`` until ``RunOptions.with_device_defaults`` fills it from ``choose_defaults``: the one place that
decides how big a run this machine should attempt.  A CPU runs tiny shapes so that a small model
finishes in seconds; a GPU runs the shapes a user trains at, on the machine it is.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapt.app.options import OptionGroup, build, flatten, group, option, replace_flat
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
PLAN_SEQ_LEN = 4096
PLAN_GLOBAL_BATCH = 64


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
BY_DEVICE = "default: chosen by --device, see `adapt run --help`"


def comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def default_out_dir(source: str) -> str:
    name = Path(source.rstrip("/")).name or "model"
    return str(Path("adapt-runs") / name.replace("@", "_"))


@dataclass
class ModelOptions(OptionGroup):
    """The checkpoint, and what adapt may run or load from it."""

    source: str = option(
        positional=True,
        metavar="SOURCE",
        help="Hugging Face id org/name[@revision], a checkpoint directory, or a config.json",
    )
    trust_remote_code: bool = option(False, help="allow the checkpoint's own modelling code to run")
    allow_pickle: bool = option(False, help="accept pickled .bin weights (loaded weights_only)")


@dataclass
class RunControl(OptionGroup):
    """Which stages run, and where their results are written."""

    out_dir: str | None = option(None, flag="--out", help="output directory (default: adapt-runs/<name>)")
    stages: list[str] = option(
        list(STAGE_NAMES),
        type=comma_list,
        help=f"comma list of stages to run (default: all of {','.join(STAGE_NAMES)})",
    )
    force: bool = option(False, help="recompute every selected stage, ignoring stored results")

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [s for s in self.stages if s not in STAGE_NAMES]
        if unknown:
            raise BadInput(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGE_NAMES)}")
        self.stages = [s for s in STAGE_NAMES if s in self.stages]


@dataclass
class OperatorOptions(OptionGroup):
    """How operators map onto kernels."""

    profile: str | None = option(
        None,
        metavar="NAME|FILE",
        help="backend profile for the operator mapping: a name (cuda-hopper, npu-restricted) or a YAML file "
        "(default: cuda-hopper)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.profile is not None:  # judged with the other options, whichever stages run
            from operators.profiles import load_profile

            load_profile(self.profile)


@dataclass
class PlanOptions(OptionGroup):
    """The cluster the model will be laid out on, and the training workload the plan targets."""

    cluster: str | None = option(
        None,
        help=f"target cluster: <N>x<GPU> (e.g. 8xH100), a cluster YAML/TOML file, or '{LOCAL_CLUSTER}' (this "
        f"machine, measured); default {CPU_CLUSTER}, or {LOCAL_CLUSTER} under `adapt run --device cuda`",
    )
    plan_seq_len: int = option(
        PLAN_SEQ_LEN,
        type=int,
        minimum=1,
        help=f"sequence length the plan and the FLOP figures target (default {PLAN_SEQ_LEN}, capped at the "
        "model's max positions)",
    )
    plan_global_batch: int = option(
        PLAN_GLOBAL_BATCH,
        flag="--global-batch",
        type=int,
        minimum=1,
        help=f"sequences per optimizer step the plan targets (default {PLAN_GLOBAL_BATCH})",
    )
    precision: str = option(
        "bf16",
        choices=("bf16", "fp8"),
        help="training precision the plan and the environment check assume (default bf16)",
    )


@dataclass
class ValidationOptions(OptionGroup):
    """Validation on this machine: the options left unset are chosen by --device.

    ``with_device_defaults`` fills them from ``choose_defaults``, for ``adapt run`` and the validation commands alike.
    """

    device: str = option(
        "cpu", help="device that validates: cpu, cuda or cuda:N (default cpu); it chooses the unset validation defaults"
    )
    dtype: str | None = option(None, choices=DTYPES, help=f"candidate dtype ({BY_DEVICE})")
    seq_len: int | None = option(None, type=int, minimum=1, old=("--seq",), help=f"tokens per sequence ({BY_DEVICE})")
    batch_size: int | None = option(
        None, type=int, minimum=1, old=("--batch",), help=f"sequences per batch ({BY_DEVICE})"
    )
    bench_steps: int | None = option(
        None, type=int, minimum=1, help=f"timed steps per throughput measurement ({BY_DEVICE})"
    )
    soak_steps: int | None = option(None, type=int, minimum=1, help=f"training steps of the soak ({BY_DEVICE})")
    ckpt_every: int | None = option(
        None, type=int, minimum=0, help=f"soak checkpoint interval in steps, 0: none ({BY_DEVICE})"
    )
    seed: int | None = option(
        None,
        type=int,
        minimum=0,
        help="seed of the inputs the validation stages draw (default: a fresh draw each run, stated in the "
        "report; a resumed soak keeps the seed stored with its checkpoints)",
    )
    thresholds: str | None = option(
        None,
        metavar="FILE",
        help="thresholds file (YAML/JSON, see reports.judge for the format): `adapt run` judges each stage with "
        "its section, as `adapt gate` does; the alignment section also sets the generation stage's limits",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise BadInput(f"--device is {self.device!r}; allowed: cpu, cuda or cuda:N")

    def with_device_defaults(self, device: DeviceDescription, positions: int | None) -> ValidationOptions:
        """These options with every unset device-sized one filled from ``choose_defaults``."""
        return replace_flat(self, **_unset_chosen(self, choose_defaults(device, positions)))


def _unset_chosen(options: Any, defaults: DeviceDefaults) -> dict[str, Any]:
    flat = flatten(options)
    return {name: getattr(defaults, name) for name in DEVICE_CHOSEN if name in flat and flat[name] is None}


@dataclass
class RunOptions:
    """Everything that shapes a run, as one tree of option groups.

    ``to_dict`` flattens it to field names (report.json's ``options``); the fields named in a stage's
    ``option_keys`` are part of that stage's cache key.
    """

    model: ModelOptions = group(ModelOptions, required=True)
    run: RunControl = group(RunControl)
    operators: OperatorOptions = group(OperatorOptions)
    plan: PlanOptions = group(PlanOptions)
    validation: ValidationOptions = group(ValidationOptions)
    # filled by ``with_device_defaults``: the machine the run validates on and which options its device chose
    machine: str | None = None
    device_chosen: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.device_chosen = tuple(self.device_chosen)
        if self.run.out_dir is None:
            self.run.out_dir = default_out_dir(self.model.source)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | argparse.Namespace) -> RunOptions:
        """The tree from flat field names: ``adapt run``'s parsed arguments, or ``to_dict``'s output."""
        return build(cls, values)

    def with_device_defaults(self, device: DeviceDescription, positions: int | None) -> RunOptions:
        """These options with every unset device-sized option filled from ``choose_defaults``."""
        filled = _unset_chosen(self, choose_defaults(device, positions))
        return replace_flat(self, **filled, machine=device.label(), device_chosen=tuple(filled))

    def subset(self, keys: tuple[str, ...]) -> dict[str, Any]:
        data = self.to_dict()
        return {k: data[k] for k in keys}

    def to_dict(self) -> dict[str, Any]:
        return flatten(self)


def select_stages(only: list[str] | None, skip: list[str] | None) -> list[str]:
    """``--stages`` and ``--skip`` (comma lists) to the ordered list of stages to run."""
    if only and all(s == REPORT_STAGE for s in only):
        raise BadInput(
            f"--stages {REPORT_STAGE} alone selects no stage (the report is written after every run); "
            f"`adapt report DIR` renders a stored one again"
        )
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
