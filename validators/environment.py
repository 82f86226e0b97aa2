"""Environment stage: is this machine sane for the plan?  Versions, device facts, measured ceilings, problems.

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

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have fp8 tensor cores


@dataclass
class DeviceInfo:
    index: int
    name: str
    capability: str
    memory_bytes: int
    multiprocessors: int


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
    passed: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


def check_environment(plan=None, precision: str = "bf16", device: str | None = None, measure: bool = True) -> EnvReport:
    """Versions, devices, measured ceilings and a list of problems for running ``plan`` at ``precision``."""
    cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    devices = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(
                DeviceInfo(i, props.name, f"{props.major}.{props.minor}", props.total_memory, props.multi_processor_count)
            )
    matmul_dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16 if cuda else torch.float32)
    report = EnvReport(
        versions=versions(),
        device_type=dev.type,
        devices=devices,
        copy_gbps=measure_copy_gbps(dev, (1 << 30) if cuda else (64 << 20)) if measure else None,
        matmul_tflops=measure_matmul_flops(dev, matmul_dtype) / 1e12 if measure else None,
        matmul_dtype=str(matmul_dtype).removeprefix("torch."),
        allreduce_gbps=None,
    )
    if report.versions["triton"] is None:
        report.problems.append("Triton is not installed: generated and hand-written kernels cannot run")
    if not cuda:
        report.unchecked += ["CUDA version and driver", "NCCL", "GPU properties", "all-reduce bandwidth", "fp8 support"]
    if precision == "fp8":
        if not cuda:
            report.problems.append("fp8 requested but there is no GPU")
        else:
            old = [d.name for d in devices if tuple(map(int, d.capability.split("."))) < FP8_MIN_CAPABILITY]
            if old:
                report.problems.append(f"fp8 requested but {', '.join(old)} has no fp8 tensor cores (needs sm_89+)")
    if plan is not None:
        needed = min(plan.world_size, plan.gpus_per_node)  # GPUs the plan puts on each node
        if cuda and needed > len(devices):
            report.problems.append(f"the plan needs {needed} GPUs per node but {len(devices)} are present")
        elif not cuda and plan.world_size > 1:
            report.problems.append(f"the plan needs {plan.world_size} GPUs but this machine has none")
    if cuda and len(devices) > 1 and measure:
        report.allreduce_gbps = measure_allreduce_gbps(len(devices))
    elif cuda and len(devices) == 1:
        report.unchecked.append("all-reduce bandwidth (one GPU)")
    report.passed = not report.problems
    return report
