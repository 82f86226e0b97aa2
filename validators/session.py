"""Single-process training through the distributed engineer's trainer (a plan of world size 1).

Bench and soak measure the loop that ``adapt train`` runs, not a private one: the model is
parallelised by ``adapt.runtime`` under a one-rank plan and stepped by its
``Trainer`` (AdamW, clipping, warm-up/decay, DCP checkpoints).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from adapt.core.errors import BadInput
from parallel_planner.plan import ParallelPlan


def ensure_single_process_group() -> None:
    """Join a one-rank process group unless torchrun (or an earlier stage) already made one.

    The rendezvous is an in-process ``HashStore``: no port is opened, and nothing is written to
    ``os.environ`` that child processes (a soak being resumed, say) would inherit.
    """
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise BadInput("bench and soak measure one device: run them without torchrun (world size 1)")


def one_rank_plan(seq_len: int, batch: int, precision: str) -> ParallelPlan:
    return ParallelPlan(
        zero=0,
        seq_len=seq_len,
        global_batch=batch,
        micro_batch=batch,
        precision="fp32" if precision == "fp32" else "bf16",
    )


def prepare_run(
    model: nn.Module,
    seq_len: int,
    batch: int,
    precision: str,
    steps: int,
    seed: int,
    deterministic: bool,
    lr: float = 3e-4,
    optimizer: str = "auto",
):
    """A ``TrainingRun`` (trainer + parallelised model) for ``model`` on this one device.  ``optimizer``:
    ``operators.optim.build_adamw``'s choice (a baseline steps with torch's AdamW, as its user would)."""
    from adapt.runtime.runner import prepare
    from adapt.runtime.trainer import TrainConfig

    ensure_single_process_group()
    config = TrainConfig(
        steps=steps,
        lr=lr,
        warmup_steps=min(10, max(1, steps // 10)),
        seed=seed,
        deterministic=deterministic,
        optimizer=optimizer,
    )
    return prepare(model, one_rank_plan(seq_len, batch, precision), config)


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
