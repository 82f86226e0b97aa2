"""Soak: train the adapted model for N steps (or T minutes) and watch that it stays healthy.

Tracked every step: loss (must stay finite), gradient norm, step time, allocated and reserved
memory.  Verdicts: non-finite loss fails; a memory slope that would grow by more than the
tolerance over the window is a leak; step-time coefficient of variation and drift are reported.
Checkpoints go through the trainer's DCP save every K steps, with the RNG state beside them, and
a ``latest`` pointer replaced atomically after each save: a run killed at any moment resumes
from the last complete checkpoint and, in deterministic mode, reproduces the uninterrupted
loss trajectory bit for bit (the data for step s is a pure function of the seed and s).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from adapt.core.errors import BadInput
from adapt.core.interrupts import deferred_interrupts
from adapt.core.jsonio import atomic_write_text, to_jsonable
from adapt.core.stage_verdicts import Check, StageSummary, SummaryContext, fmt, judged, soak_checks
from validators.align import kernel_plan_transform
from validators.alignment import check_device
from validators.compare import parse_dtype

LEAK_TOLERANCE_BYTES = {"cuda": 1 << 20, "cpu": 64 << 20}  # the CPU heap is process-wide and noisier


@dataclass
class SoakOptions:
    steps: int = 100
    minutes: float | None = None  # stop early once this much wall time has passed
    ckpt_every: int = 0  # 0: no checkpoints
    ckpt_dir: str | None = None
    dtype: str = "bf16"
    seq_len: int = 128
    batch: int = 2
    seed: int | None = None  # None: a fresh draw, or the one stored with the checkpoints being resumed
    deterministic: bool = True
    lr: float = 3e-4


@dataclass
class SoakStep:
    step: int
    loss: float
    grad_norm: float
    step_time_s: float
    allocated_bytes: int
    reserved_bytes: int | None


@dataclass
class SoakReport:
    source: str
    device: str
    dtype: str
    steps_planned: int
    steps_done: int
    resumed_from: int | None
    seed: int  # the data seed: step s trains on a pure function of (seed, s)
    checkpoints: list[int]
    losses: list[float]  # whole trajectory, including steps run before a resume
    loss_finite: bool
    step_time_cv: float | None
    step_time_drift: float | None  # median of the last quarter / median of the first quarter
    memory_slope_bytes_per_step: float | None
    leak: bool
    steps: list[SoakStep] = field(default_factory=list)  # steps run by this process
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """The soak rule at its default limits: the one place that decides, so ``adapt gate`` cannot disagree."""
        return judged(self.verdict())

    def to_dict(self) -> dict[str, Any]:
        """The fields, with the pass flag that report.json's readers expect beside them."""
        return {**self._fields(), "passed": self.passed}

    def _fields(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["losses"] = [x if math.isfinite(x) else None for x in self.losses]
        return data

    def summary(self, context: SummaryContext | None = None) -> StageSummary:
        """What the report shows of the soak stage, judged by ``soak_checks``: finite losses and no leak."""
        context = context or SummaryContext()
        report = to_jsonable(self._fields())
        step_keys = ("step", "loss", "grad_norm", "step_time_s", "allocated_bytes", "reserved_bytes")
        losses = report.get("losses") or [None]
        data = {
            "device": report.get("device", context.device),
            "dtype": report.get("dtype", context.dtype),
            "steps": report.get("steps_done"),
            "steps_planned": report.get("steps_planned"),
            "resumed_from": report.get("resumed_from"),
            "checkpoints": report.get("checkpoints", []),
            "loss_finite": report.get("loss_finite"),
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "step_time_cv": report.get("step_time_cv"),
            "step_time_drift": report.get("step_time_drift"),
            "memory_slope_bytes_per_step": report.get("memory_slope_bytes_per_step"),
            "leak": report.get("leak"),
            "timeline": [{k: step.get(k) for k in step_keys} for step in report.get("steps", [])],
            "shapes": {"seq_len": context.seq_len, "batch_size": context.batch_size},
        }
        slope = self.memory_slope_bytes_per_step
        line = (
            f"{self.steps_done}/{self.steps_planned} steps, loss {fmt(data['first_loss'], '.3f')} -> "
            f"{fmt(data['last_loss'], '.3f')} ({'finite' if self.loss_finite else 'NON-FINITE'}), "
            f"step-time CV {fmt(self.step_time_cv, '.2f')}, "
            f"memory slope {fmt(None if slope is None else slope / 2**20, '.2f')} "
            f"MiB/step ({'LEAK' if self.leak else 'no leak'}), {len(self.checkpoints)} checkpoints"
        )
        if self.resumed_from is not None:
            line += f", resumed from step {self.resumed_from}"
        return StageSummary(line, data, soak_checks(data, context.section("soak")))

    def verdict(self, thresholds: dict[str, Any] | None = None) -> list[Check]:
        return soak_checks(self.summary().data, thresholds)


def _release_unreachable(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _memory(device: torch.device) -> tuple[int, int | None]:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    in_use = _malloc_bytes_in_use()
    if in_use is not None:
        return in_use, None
    import psutil

    return psutil.Process().memory_info().rss, None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _malloc_bytes_in_use() -> int | None:
    """Bytes the C heap has handed out and not got back (glibc ``mallinfo2``), None elsewhere.

    Process RSS misses a leak whose allocations reuse heap pages freed earlier in the process;
    glibc's own count of bytes in use does not, which is what a leak verdict on the CPU needs.
    """
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


class CheckpointStore:
    """``ckpt_dir/step-NNNNNNNN`` DCP directories, ``rng.pt`` inside each, ``latest`` naming the newest complete one.

    A step is written under ``.partial-step-NNNNNNNN`` and renamed once DCP and the RNG state are on
    disk, so an interrupted write (Ctrl-C, SIGTERM, a crash) leaves no folder that looks like a
    checkpoint; leftovers are removed when the store opens.  The rename and the pointer update run
    with signals held, and an interrupt DCP wrapped into its own exception is raised as itself.
    """

    PARTIAL_PREFIX = ".partial-"

    def __init__(self, root: str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.history = self.root / "history.jsonl"
        for leftover in self.root.glob(f"{self.PARTIAL_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        target = self.root / pointer.read_text().strip()
        return target if (target / "rng.pt").is_file() else None

    def save(self, run, step: int) -> None:
        from adapt.runtime import checkpoint

        name = f"step-{step:08d}"
        partial = self.root / f"{self.PARTIAL_PREFIX}{name}"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            checkpoint.save(partial, run.pmodel, run.trainer.optimizers, step)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP's CheckpointException is a BaseException wrapping each rank's error
            interrupt = _wrapped_interrupt(err)
            if interrupt is not None:
                raise interrupt from None
            if isinstance(err, Exception):
                raise
            raise RuntimeError(f"checkpoint save at step {step} failed: {_last_line(str(err))}") from err
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, partial / "rng.pt")
        with deferred_interrupts():  # the step folder and the pointer to it change together
            target = self.root / name
            shutil.rmtree(target, ignore_errors=True)
            os.replace(partial, target)
            tmp = self.root / "latest.tmp"
            tmp.write_text(target.name)
            os.replace(tmp, self.root / "latest")

    def restore(self, run) -> int:
        from adapt.runtime import checkpoint

        target = self.latest()
        step = checkpoint.load(target, run.pmodel, run.trainer.optimizers)
        rng = torch.load(target / "rng.pt", weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])
        run.trainer.step = step
        for sched in run.trainer.schedulers:
            sched.last_epoch = step - 1
            sched.step()
        return step

    def pin_seed(self, requested: int | None) -> int:
        """The data seed of the run in this directory: a resumed run keeps the one its checkpoints were trained
        with (another would train different data from the resumed step on); a new run takes ``requested`` or a
        fresh draw, and stores it."""
        path = self.root / "seed"
        if self.latest() is not None and path.is_file():
            stored = int(path.read_text())
            if requested is not None and requested != stored:
                raise BadInput(
                    f"{self.root} holds a soak trained with seed {stored}, not {requested}: resume with "
                    f"--seed {stored} (or no --seed), or use a new checkpoint directory"
                )
            return stored
        seed = _seed_or_fresh(requested)
        tmp = self.root / "seed.tmp"
        tmp.write_text(str(seed))
        os.replace(tmp, path)
        return seed

    def read_history(self, before: int) -> list[dict[str, Any]]:
        """History lines of steps before ``before``; later ones were lost with the killed run and are rewritten.

        A run killed while appending leaves a torn last line: it is after every checkpoint, so it is dropped with
        the other lines past ``before``.  The rewrite is atomic, so a second kill loses nothing either."""
        if not self.history.is_file():
            return []
        rows = []
        for line in self.history.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
        kept = [r for r in rows if r["step"] < before]
        atomic_write_text(self.history, "".join(json.dumps(r) + "\n" for r in kept))
        return kept


def _seed_or_fresh(seed: int | None) -> int:
    return seed if seed is not None else int.from_bytes(os.urandom(4), "little")


def _wrapped_interrupt(err: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (or Terminated) inside an exception DCP raised, if there is one."""
    seen: set[int] = set()
    pending: list[Any] = [err]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, KeyboardInterrupt):
            return item
        if isinstance(item, BaseException):
            pending.extend(x for x in (item.__cause__, item.__context__) if x is not None)
            failures = getattr(item, "failures", None)
            if isinstance(failures, dict):
                pending.extend(failures.values())
        elif isinstance(item, tuple):  # DCP keeps (exception, traceback) pairs per rank
            pending.extend(item)
    return None


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def soak(
    src,
    kernel_plan: Any = None,
    steps: int = 100,
    ckpt_every: int = 0,
    device: str = "cpu",
    dtype: str = "bf16",
    seq_len: int = 128,
    batch_size: int = 2,
    ckpt_dir: str | None = None,
    minutes: float | None = None,
    seed: int | None = None,
    deterministic: bool = True,
    transform=None,
    progress: Callable[[int, int, str], None] | None = None,
) -> SoakReport:
    """Train for ``steps`` steps (or ``minutes``), checkpointing every ``ckpt_every`` into ``ckpt_dir``.

    A ``ckpt_dir`` that already holds a checkpoint is resumed from; the step count must match the
    original run (it shapes the learning-rate schedule).
    """
    from adapt.model.skeleton import load_model
    from validators.session import prepare_run

    options = SoakOptions(steps, minutes, ckpt_every, ckpt_dir, dtype, seq_len, batch_size, seed, deterministic)
    check_device(device)
    if options.steps < 1:
        raise BadInput("--steps must be at least 1")
    if options.ckpt_every < 0 or (options.ckpt_every and not options.ckpt_dir):
        raise BadInput("--ckpt-every must be >= 0 and needs a checkpoint directory")
    torch_dtype = parse_dtype(options.dtype)
    notes: list[str] = []
    transform = transform or kernel_plan_transform(kernel_plan, notes)
    _release_unreachable(device)  # earlier stages' garbage must not show up as this run's memory trend
    model = load_model(src, torch_dtype, device, notes)
    if transform is not None:
        model = transform(model) or model
    store = CheckpointStore(options.ckpt_dir) if options.ckpt_dir else None
    seed = store.pin_seed(options.seed) if store is not None else _seed_or_fresh(options.seed)
    options = dataclasses.replace(options, seed=seed)
    run = prepare_run(
        model,
        options.seq_len,
        options.batch,
        options.dtype,
        options.steps,
        options.seed,
        options.deterministic,
        options.lr,
    )
    resumed_from, history = None, []
    if store is not None and store.latest() is not None:
        resumed_from = store.restore(run)
        history = store.read_history(resumed_from)
    elif store is not None:
        store.read_history(0)
    dev = run.pmodel.dims.device
    started, records, checkpoints = time.perf_counter(), [], []
    while run.trainer.step < options.steps:
        if options.minutes is not None and time.perf_counter() - started > 60 * options.minutes:
            notes.append(f"stopped after {options.minutes} minutes at step {run.trainer.step}")
            break
        run.pmodel.train()
        metrics = run.trainer.train_step()
        allocated, reserved = _memory(dev)
        record = SoakStep(metrics.step, metrics.loss, metrics.grad_norm, metrics.step_time_s, allocated, reserved)
        records.append(record)
        if store is not None:
            with store.history.open("a") as fh:
                fh.write(json.dumps({"step": record.step, "loss": record.loss}) + "\n")
        if not math.isfinite(metrics.loss):
            notes.append(f"loss became non-finite at step {metrics.step}")
            break
        if store is not None and options.ckpt_every and run.trainer.step % options.ckpt_every == 0:
            store.save(run, run.trainer.step)
            checkpoints.append(run.trainer.step)
        if progress is not None:
            progress(run.trainer.step, options.steps, f"loss {metrics.loss:.4f}")
    return _verdict(src, device, options, resumed_from, history, records, checkpoints, notes, dev.type)


def _verdict(src, device, options, resumed_from, history, records, checkpoints, notes, device_type) -> SoakReport:
    losses = [r["loss"] for r in history] + [r.loss for r in records]
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    warm = max(2, len(records) // 3)  # allocator and cache warm-up settles within the first third
    window = records[warm:]
    cv = drift = slope = None
    if len(window) >= 4:
        times = [r.step_time_s for r in window]
        cv = statistics.pstdev(times) / statistics.mean(times)
        quarter = max(1, len(times) // 4)
        drift = statistics.median(times[-quarter:]) / statistics.median(times[:quarter])
        slope = _slope([r.step for r in window], [r.allocated_bytes for r in window])
    leak = slope is not None and slope * len(window) > LEAK_TOLERANCE_BYTES[device_type]
    if leak:
        notes.append(f"allocated memory grows {slope / 2**10:.1f} KiB per step")
    return SoakReport(
        source=src.text,
        device=device,
        dtype=options.dtype,
        steps_planned=options.steps,
        steps_done=len(losses),
        resumed_from=resumed_from,
        seed=options.seed,
        checkpoints=checkpoints,
        losses=losses,
        loss_finite=finite,
        step_time_cv=cv,
        step_time_drift=drift,
        memory_slope_bytes_per_step=slope,
        leak=leak,
        steps=records,
        notes=notes,
    )


def _slope(xs: list[int], ys: list[int]) -> float:
    """Least-squares slope of ys over xs."""
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0
