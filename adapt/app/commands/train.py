"""``adapt train SOURCE --plan PLAN.json``: train under a parallel plan (run it with torchrun or ``adapt launch``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
from pathlib import Path

from adapt.app.commands.flags import add_json
from adapt.app.options import add_options
from adapt.app.pipeline.options import ModelOptions
from adapt.core.errors import BadInput


def _plan(path: str):
    from parallel_planner.plan import ParallelPlan

    if not Path(path).is_file():
        raise BadInput(f"plan file not found: {path}")
    return ParallelPlan.load(path)


def _single_process_env() -> None:
    """Outside torchrun a one-process plan still gets a (one-rank) process group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        os.environ.setdefault(key, value)


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        # Every rank reaches this point before any tears down: no collective is left in flight
        # when gloo/NCCL threads are destroyed.
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, ModelOptions, only=("source", "trust_remote_code"))
    p.add_argument(
        "--plan",
        required=True,
        help="plan JSON from `adapt plan` (a bare plan or a ranked answer)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=10,
        help="total optimizer steps; a resumed run continues up to N (default 10)",
    )
    p.add_argument(
        "--ckpt",
        help="DCP checkpoint directory: resumed from when present, written at the end",
    )
    p.add_argument(
        "--export-hf",
        help="also write a plain HF safetensors checkpoint here at the end",
    )
    p.add_argument(
        "--data",
        help="token file (.npy of ints or raw uint16 .bin); default: synthetic stream",
    )
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        help="linear warm-up steps before cosine decay (default 2)",
    )
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="gradient clipping norm (default 1.0)",
    )
    p.add_argument(
        "--train-seed",
        type=int,
        default=0,
        help="seed of the weight initialisation and synthetic data, the same on every rank (default 0)",
    )
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels (slower)")
    p.add_argument(
        "--optimizer",
        choices=("auto", "adapt", "torch"),
        default="auto",
        help="AdamW kernel: adapt's one-launch Triton update on CUDA where it runs (auto), insist on it (adapt), "
        "or torch's fused/foreach AdamW (torch)",
    )
    p.add_argument("--metrics", help="write per-step metrics as JSON lines here (rank 0)")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model under a parallel plan (FSDP2/TP/PP/CP/EP on torch.distributed)",
        description="Run under torchrun (see `adapt launch`); a one-process plan also runs directly. "
        "Prints loss, gradient norm, tokens/s and peak memory per step.",
    )
    add_train_arguments(p)
    add_json(p, "every step's metrics")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    plan = _plan(args.plan)
    if args.steps < 1:
        raise BadInput("--steps must be >= 1")
    if "RANK" not in os.environ:
        if plan.world_size != 1:
            raise BadInput(
                f"this plan needs {plan.world_size} processes: start it with `adapt launch ... --execute` or torchrun"
            )
        _single_process_env()
    from adapt.runtime.runner import run_training
    from adapt.runtime.trainer import TrainConfig, is_main_process

    config = TrainConfig(
        steps=args.steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm,
        seed=args.train_seed,
        deterministic=args.deterministic,
        data=args.data,
        optimizer=args.optimizer,
    )
    with contextlib.ExitStack() as stack:
        metrics_file = stack.enter_context(open(args.metrics, "w")) if args.metrics and is_main_process() else None

        steps: list[dict] = []

        def report(m) -> None:
            if not is_main_process():
                return
            if args.json:
                steps.append(m.to_dict())
            else:
                print(
                    f"step {m.step:>5}  loss {m.loss:.4f}  grad_norm {m.grad_norm:.3f}  lr {m.lr:.2e}  "
                    f"tokens/s {m.tokens_per_s:,.0f}  peak_mem {m.peak_memory_gib:.2f} GiB",
                    flush=True,
                )
            if metrics_file:
                metrics_file.write(json.dumps(m.to_dict()) + "\n")
                metrics_file.flush()

        stack.callback(_leave_process_group)
        run_training(
            args.source,
            plan,
            config,
            ckpt_dir=args.ckpt,
            export_dir=args.export_hf,
            trust_remote_code=args.trust_remote_code,
            on_step=report,
        )
    if args.json and is_main_process():
        print(json.dumps({"steps": steps}), flush=True)
    return 0
