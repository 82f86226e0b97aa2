"""Entry points shared by ``adapt train``, the throughput/soak stages and the tests."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from adapt.model.calls import token_vocab
from adapt.runtime import checkpoint
from adapt.runtime.adapted import AdaptOptions
from adapt.runtime.mesh import (
    ParallelDims,
    build_parallel_dims,
    default_device,
)
from adapt.runtime.parallelize import ParallelModel, parallelize
from adapt.runtime.trainer import (
    TrainConfig,
    Trainer,
    TrainResult,
    cross_entropy,
    set_determinism,
)
from parallel_planner.plan import ParallelPlan


def init_distributed() -> torch.device:
    """Join the torchrun rendezvous (NCCL on CUDA, gloo otherwise); idempotent."""
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo")
    return default_device()


@dataclass
class TrainingRun:
    dims: ParallelDims
    pmodel: ParallelModel
    trainer: Trainer
    model_config: Any


def prepare(
    model: nn.Module,
    plan: ParallelPlan,
    config: TrainConfig,
    spec: Any = None,
    adapt: AdaptOptions | None = None,
) -> TrainingRun:
    """Parallelise an already-loaded model (same weights on every rank) and build its trainer;
    ``adapt`` applies the kernel plan and per-block compilation on each chunk."""
    set_determinism(config.seed, config.deterministic)
    dims = build_parallel_dims(plan)
    model = model.to(dims.device).train()
    local_batch = plan.global_batch // plan.dp
    micro_shape = (max(1, local_batch // plan.grad_accum), plan.seq_len)
    vocab = token_vocab(model)
    pmodel = parallelize(
        model,
        dims,
        micro_batch_shape=micro_shape,
        loss_fn=cross_entropy,
        spec=spec,
        adapt=adapt,
    )
    return TrainingRun(dims, pmodel, Trainer(pmodel, config, vocab), model.config)


def load_for_training(source: str, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32) -> nn.Module:
    from adapt.model.intake import load_model, resolve_source

    return load_model(resolve_source(source, trust_remote_code=trust_remote_code), dtype=dtype)


def run_training(
    source: str,
    plan: ParallelPlan,
    config: TrainConfig,
    *,
    ckpt_dir: str | None = None,
    export_dir: str | None = None,
    trust_remote_code: bool = False,
    on_step=None,
    adapt: AdaptOptions | None = None,
) -> TrainResult:
    """Train ``source`` under ``plan``; resume from ``ckpt_dir`` when it holds a checkpoint, save there at the end.
    ``adapt`` trains the adapted model (kernel plan, compiled blocks)."""
    init_distributed()
    set_determinism(config.seed, config.deterministic)  # before loading: config-only models init randomly
    run = prepare(load_for_training(source, trust_remote_code), plan, config, adapt=adapt)
    if ckpt_dir and (Path(ckpt_dir) / ".metadata").is_file():
        run.trainer.restore(checkpoint.load(ckpt_dir, run.pmodel, run.trainer.optimizers))
    result = run.trainer.fit(on_step=on_step)
    if ckpt_dir:
        checkpoint.save(ckpt_dir, run.pmodel, run.trainer.optimizers, run.trainer.step)
    if export_dir:
        checkpoint.export_hf(export_dir, run.pmodel, run.model_config)
    return result
