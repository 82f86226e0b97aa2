"""Environment stage: is this machine sane?  Versions, device facts, measured ceilings, problems.

The stage judges the machine it runs on.  It judges that machine against the parallel plan only
when the plan targets it (``PlanTarget.is_this_machine``); a plan for another cluster earns a
note, since this machine was never meant to run it.

Measured, not looked up: a device-to-device copy (bytes read + written), a square matmul rate
in the run's precision, and an all-reduce bus bandwidth when several GPUs are visible.  On a
CPU-only machine the stage still runs and lists, under ``unchecked``, what it could not check.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from adapt.core.jsonio import to_jsonable
from adapt.core.stage_verdicts import Check, StageSummary, SummaryContext, environment_checks, judged

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have fp8 tensor cores


@dataclass
class DeviceInfo:
    index: int
    name: str
    capability: str
    memory_bytes: int
    multiprocessors: int


@dataclass(frozen=True)
class PlanTarget:
    """The cluster a plan was made for, as far as judging it on this machine needs."""

    name: str  # as the user gave it: "local", "8xH100", a cluster file
    gpu: str  # catalogue GPU name, e.g. "h100"
    num_gpus: int
    gpus_per_node: int
    local: bool = False  # planned for this machine from its own measurements (``--cluster local``)

    def is_this_machine(self, devices: list[DeviceInfo]) -> bool:
        """``local``, or one node of exactly this machine's GPUs (``1xH200`` on a one-H200 machine)."""
        if self.local:
            return True
        if not devices or self.num_gpus != len(devices) or self.gpus_per_node != len(devices):
            return False
        return _squash(self.gpu) in _squash(devices[0].name)


def _squash(name: str) -> str:
    return name.lower().replace(" ", "").replace("-", "").replace("_", "")


@dataclass
class EnvReport:
    versions: dict[str, str | None]
    device_type: str
    devices: list[DeviceInfo]
    copy_gbps: float | None  # bytes read + written per second / 1e9
    matmul_tflops: float | None
    matmul_dtype: str
    allreduce_gbps: float | None  # NCCL bus bandwidth, several GPUs only
    problems: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plan_target: str | None = None  # the cluster the judged plan targets
    judged_against_plan: bool = False

    @property
    def passed(self) -> bool:
        """The environment rule at its default limits: the one place that decides, so ``adapt gate`` cannot
        disagree."""
        return judged(self.verdict())

    def to_dict(self) -> dict[str, Any]:
        """The fields, with the pass flag that report.json's readers expect beside them."""
        return {**dataclasses.asdict(self), "passed": self.passed}

    def summary(self, context: SummaryContext | None = None) -> StageSummary:
        """What the report shows of the environment stage: any problem found fails it."""
        context = context or SummaryContext()
        report = to_jsonable(dataclasses.asdict(self))
        measured = {
            k: report.get(k) for k in ("copy_gbps", "matmul_tflops", "matmul_dtype", "allreduce_gbps") if k in report
        }
        data = {
            "versions": report.get("versions", {}),
            "device_type": report.get("device_type"),
            "devices": report.get("devices", []),
            "measured": measured,
            "problems": list(self.problems),
            "unchecked": list(self.unchecked),
            "plan_target": self.plan_target,
            "judged_against_plan": self.judged_against_plan,
        }
        problems, rate = data["problems"], measured.get("matmul_tflops")
        line = f"{data['device_type'] or context.device}: {len(problems)} problem(s)" + (
            f" ({problems[0]})" if problems else ""
        )
        if rate is not None:
            line += f", matmul {rate:.2f} TFLOP/s {measured.get('matmul_dtype', '')}"
        if self.plan_target and not self.judged_against_plan:
            line += f"; the plan for {self.plan_target} is not judged on this machine"
        if self.unchecked:
            line += f"; {len(self.unchecked)} check(s) not possible here"
        return StageSummary(line, data, environment_checks(data, context.section("environment")))

    def verdict(self, thresholds: dict[str, Any] | None = None) -> list[Check]:
        return environment_checks(self.summary().data, thresholds)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            found = torch.cuda.nccl.version()
            nccl = ".".join(map(str, found)) if isinstance(found, tuple) else str(found)
        except (RuntimeError, AttributeError):
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "nccl": nccl,
        "transformers": _version("transformers"),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, reps: int = 5) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_copy_gbps(device: torch.device, nbytes: int) -> float:
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / seconds / 1e9


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int | None = None) -> float:
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _best_time(lambda: a @ b, device)
    return 2 * n**3 / seconds


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_allreduce_gbps(world: int, nbytes: int = 256 << 20) -> float:
    """Bus bandwidth of an NCCL all-reduce across ``world`` local GPUs, one process each."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_allreduce_worker, args=(world, nbytes, _free_port(), queue), nprocs=world, join=True)
    return queue.get()


def _allreduce_worker(rank: int, world: int, nbytes: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = torch.randn(nbytes // 4, device="cuda")
    device = torch.device("cuda", rank)
    seconds = _best_time(lambda: dist.all_reduce(data), device)
    if rank == 0:  # ring all-reduce moves 2(n-1)/n of the buffer per rank
        queue.put(nbytes * 2 * (world - 1) / world / seconds / 1e9)
    dist.destroy_process_group()


def local_devices() -> list[DeviceInfo]:
    """The GPUs this process sees."""
    return [
        DeviceInfo(i, p.name, f"{p.major}.{p.minor}", p.total_memory, p.multi_processor_count)
        for i, p in ((i, torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count()))
    ]


def judge_plan(
    plan, precision: str, devices: list[DeviceInfo], target: PlanTarget | None
) -> tuple[list[str], list[str], bool]:
    """(problems, notes, judged) of running ``plan`` at ``precision`` on a machine with ``devices``.

    Without a ``target`` the plan is taken to be meant for this machine.  A target elsewhere is
    not held against this machine: it gets a note saying what was not checked.
    """
    if target is not None and not target.is_this_machine(devices):
        here = f"{len(devices)}x {devices[0].name}" if devices else "no GPU"
        needs = f"{plan.world_size} GPU(s), {min(plan.world_size, plan.gpus_per_node)} per node" if plan else "GPUs"
        unchecked = f"its {needs}" + (" and fp8 support" if precision == "fp8" else "")
        return [], [f"the plan targets {target.name}, not this machine ({here}): {unchecked} not checked here"], False
    problems = []
    if precision == "fp8":
        if not devices:
            problems.append("fp8 requested but there is no GPU")
        else:
            old = [d.name for d in devices if tuple(map(int, d.capability.split("."))) < FP8_MIN_CAPABILITY]
            if old:
                problems.append(f"fp8 requested but {', '.join(old)} has no fp8 tensor cores (needs sm_89+)")
    if plan is not None:
        needed = min(plan.world_size, plan.gpus_per_node)  # GPUs the plan puts on each node
        if devices and needed > len(devices):
            problems.append(f"the plan needs {needed} GPUs per node but {len(devices)} are present")
        elif not devices and plan.world_size > 1:
            problems.append(f"the plan needs {plan.world_size} GPUs but this machine has none")
    return problems, [], plan is not None


def check_environment(
    plan=None,
    precision: str = "bf16",
    device: str | None = None,
    measure: bool = True,
    target: PlanTarget | None = None,
) -> EnvReport:
    """Versions, devices, measured ceilings and this machine's problems.

    ``plan`` (a ParallelPlan) is judged against this machine when ``target`` is this machine or
    absent; a plan that targets another cluster only adds a note.
    """
    cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    devices = local_devices() if cuda else []
    matmul_dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(
        precision, torch.bfloat16 if cuda else torch.float32
    )
    report = EnvReport(
        versions=versions(),
        device_type=dev.type,
        devices=devices,
        copy_gbps=measure_copy_gbps(dev, (1 << 30) if cuda else (64 << 20)) if measure else None,
        matmul_tflops=measure_matmul_flops(dev, matmul_dtype) / 1e12 if measure else None,
        matmul_dtype=str(matmul_dtype).removeprefix("torch."),
        allreduce_gbps=None,
        plan_target=target.name if target is not None else None,
    )
    if report.versions["triton"] is None:
        report.problems.append("Triton is not installed: generated and hand-written kernels cannot run")
    if not cuda:
        report.unchecked += ["CUDA version and driver", "NCCL", "GPU properties", "all-reduce bandwidth", "fp8 support"]
    problems, notes, report.judged_against_plan = judge_plan(plan, precision, devices, target)
    report.problems += problems
    report.notes += notes
    if cuda and len(devices) > 1 and measure:
        report.allreduce_gbps = measure_allreduce_gbps(len(devices))
    elif cuda and len(devices) == 1:
        report.unchecked.append("all-reduce bandwidth (one GPU)")
    return report
