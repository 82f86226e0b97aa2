"""A small real training loop over a realised plan: AdamW, clipping, warm-up + cosine decay, metrics.

Reads top to bottom: build the meshes, load and parallelise the model, then per step draw the
global batch, keep this rank's data-parallel slice, run forward/backward (micro-batched, or
through the pipeline schedule), reduce expert gradients, clip by the true global norm, step.
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from adapt.runtime.context_parallel import (
    context_parallel_batch,
    position_ids_for,
)
from adapt.runtime.data import make_data
from adapt.runtime.data_parallel import set_micro_batch_sync
from adapt.runtime.parallelize import ParallelModel
from adapt.runtime.pipeline import logits_of
from operators.optim import build_adamw


@dataclass
class TrainConfig:
    steps: int = 10
    lr: float = 3e-4
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1  # cosine decay floor, as a fraction of lr
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    seed: int = 0
    deterministic: bool = False
    data: str | None = None  # token file; None = synthetic stream
    optimizer: str = "auto"  # operators.optim.build_adamw: adapt's AdamW kernel where it runs, else torch's


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    step_time_s: float
    peak_memory_gib: float  # CUDA: max allocated on this device; CPU: peak resident set of this process

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrainResult:
    steps: list[StepMetrics] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"steps": [s.to_dict() for s in self.steps]}


def set_determinism(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def _has_fused_loss(model: nn.Module) -> bool:
    """adapt's kernel plan replaced this causal LM's head with a fused linear cross-entropy
    (``operators.providers.triton_head``): its forward computes the loss without materialising logits."""
    return bool(getattr(model.forward, "adapt_fused_loss", False))


def lr_lambda(config: TrainConfig):
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        span = max(1, config.steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def reduce_partial_grads(params: list[nn.Parameter]) -> int:
    """Sum gradients left as partial sums (replicated parameters fed sharded rows: norms under sequence
    parallelism) once, in one all-reduce per mesh; returns how many.  Left partial, every optimizer
    and clipping op on them would all-reduce again (several collectives per parameter per step)."""
    pending: dict[Any, list[nn.Parameter]] = {}
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements == (Partial(),) and param.placements == (Replicate(),):
            pending.setdefault(grad.device_mesh, []).append(param)
    for mesh, group in pending.items():
        locals_ = [p.grad.to_local() for p in group]
        flat = torch.cat([g.reshape(-1) for g in locals_])
        dist.all_reduce(flat, group=mesh.get_group())
        for param, piece in zip(group, flat.split([g.numel() for g in locals_])):
            param.grad = DTensor.from_local(piece.view_as(param.grad.to_local()), mesh, [Replicate()], run_check=False)
    return sum(len(g) for g in pending.values())


def clip_grad_norm(pmodel: ParallelModel, max_norm: float) -> torch.Tensor:
    """Clip by the norm of the whole model's gradient, across every mesh dimension, and return it.

    The norm stays on the device (a 0-dim tensor): reading it here would make the host wait for the backward
    before it queues the optimizer, leaving the device idle while the optimizer's launches are issued."""
    groups: dict[Any, list[torch.Tensor]] = {}
    expert_ids = {id(p) for p in (pmodel.experts.params if pmodel.experts else [])}
    counted_elsewhere = pmodel.tied.param if pmodel.tied and not pmodel.tied.counted_in_norm else None
    scale_only: list[torch.Tensor] = []
    for param in pmodel.parameters():
        if param.grad is None:
            continue
        grad = param.grad
        if param is counted_elsewhere:  # the same summed gradient is counted on the first stage
            scale_only.append(grad)
            continue
        key = (
            (grad.device_mesh, grad.placements)
            if isinstance(grad, DTensor)
            else ("expert" if id(param) in expert_ids else "local")
        )
        groups.setdefault(key, []).append(grad)
    device = pmodel.dims.device
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    for key, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        square = norm.float() ** 2
        if key == "expert":  # each ep rank owns different experts
            dist.all_reduce(square, group=pmodel.experts.ep_mesh.get_group())
        total_sq = total_sq + square
    if pmodel.dims.plan.pp > 1:
        dist.all_reduce(total_sq, group=pmodel.dims.mesh("pp").get_group())
    total = total_sq.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in [*groups.values(), *([scale_only] if scale_only else [])]:
        torch._foreach_mul_(grads, scale.to(grads[0].device))  # a DTensor list takes a plain 0-dim tensor too
    return total


class Trainer:
    def __init__(self, pmodel: ParallelModel, config: TrainConfig, vocab_size: int):
        self.pmodel, self.config = pmodel, config
        plan = pmodel.dims.plan
        self.plan = plan
        self.data = make_data(config.data, vocab_size, plan.seq_len, config.seed)
        if plan.global_batch % plan.dp or (plan.global_batch // plan.dp) % plan.grad_accum:
            from adapt.core.errors import BadInput

            raise BadInput(
                f"global_batch={plan.global_batch} must split into dp={plan.dp} x grad_accum={plan.grad_accum}"
            )
        built = [
            build_adamw(
                chunk.parameters(), config.optimizer, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
            )
            for chunk in pmodel.chunks
        ]
        self.optimizers = [optimizer for optimizer, _ in built]
        self.optimizer_kind = built[0][1] if built else "none"
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(config)) for opt in self.optimizers]
        self.step = 0

    def restore(self, step: int) -> None:
        """Continue a loaded checkpoint: the next step is ``step`` and its learning rate follows the schedule."""
        self.step = step
        for sched in self.schedulers:
            sched.last_epoch = step - 1
            sched.step()

    def local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.plan
        batch = self.data.global_batch(step, plan.global_batch)
        per_rank = plan.global_batch // plan.dp
        rank = self.pmodel.dims.dp_rank
        local = batch[rank * per_rank : (rank + 1) * per_rank].to(self.pmodel.dims.device)
        return local[:, :-1].contiguous(), local[:, 1:].contiguous()

    def _forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pm, plan = self.pmodel, self.plan
        if pm.schedule is not None:
            losses: list[torch.Tensor] = []
            args = (inputs,) if pm.has_first_stage else ()
            pm.schedule.step(
                *args,
                target=labels if pm.has_last_stage else None,
                losses=losses if pm.has_last_stage else None,
            )
            return torch.stack(losses).mean().detach() if losses else torch.zeros((), device=inputs.device)
        model = pm.chunks[0]
        total = torch.zeros((), device=inputs.device)
        for index, (micro_in, micro_labels) in enumerate(
            zip(inputs.chunk(plan.grad_accum), labels.chunk(plan.grad_accum))
        ):
            set_micro_batch_sync(
                model.modules(),
                plan.zero,
                last_micro_batch=index == plan.grad_accum - 1,
            )
            if plan.cp > 1:
                positions = position_ids_for(micro_in)
                with context_parallel_batch(pm.dims.mesh("cp"), [micro_in, micro_labels, positions]):
                    logits = logits_of(
                        model(
                            input_ids=micro_in,
                            position_ids=positions,
                            attention_mask=torch.ones_like(micro_in),
                            use_cache=False,
                        ),
                        model,
                    )
                    loss = cross_entropy(logits, micro_labels) / plan.grad_accum
                    loss.backward()
            else:
                loss = self._micro_loss(model, micro_in, micro_labels) / plan.grad_accum
                loss.backward()
            total += loss.detach()
        return total

    def _micro_loss(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy.  A head patched with adapt's fused linear cross-entropy gets the
        already-shifted labels (``shift_labels``) and never materialises the logits; the math is the
        cross-entropy below either way (the patch was confirmed numerically against the model's loss)."""
        if self.plan.tp == 1 and _has_fused_loss(model):
            return model(input_ids=inputs, labels=labels, shift_labels=labels, use_cache=False).loss
        return cross_entropy(logits_of(model(input_ids=inputs, use_cache=False), model), labels)

    def _global_loss(self, local_loss: torch.Tensor) -> float:
        """Mean over data/context-parallel ranks; tp ranks repeat it and only the last pp stage has it."""
        dims = self.pmodel.dims
        owns = self.pmodel.has_last_stage and dims.world["tp"].get_local_rank() == 0
        pair = torch.stack(
            [
                local_loss.float() * owns,
                torch.tensor(float(owns), device=local_loss.device),
            ]
        )
        dist.all_reduce(pair)
        return float(pair[0] / pair[1])

    def train_step(self) -> StepMetrics:
        start = time.perf_counter()
        inputs, labels = self.local_batch(self.step)
        local_loss = self._forward_backward(inputs, labels)
        if self.pmodel.experts is not None:
            self.pmodel.experts.reduce_expert_gradients()
        if self.pmodel.tied is not None:
            self.pmodel.tied.sync_grads()
        if self.plan.tp > 1:
            reduce_partial_grads(self.pmodel.parameters())
        grad_norm = clip_grad_norm(self.pmodel, self.config.max_grad_norm)
        lr = self.schedulers[0].get_last_lr()[0]
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        loss = self._global_loss(local_loss)
        grad_norm = float(grad_norm)  # the step's work is queued: reading it now costs no idle device time
        if self.pmodel.dims.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        tokens = self.plan.global_batch * self.plan.seq_len
        metrics = StepMetrics(
            self.step,
            loss,
            grad_norm,
            lr,
            tokens / elapsed,
            elapsed,
            _peak_memory_gib(self.pmodel.dims.device),
        )
        self.step += 1
        return metrics

    def fit(self, steps: int | None = None, on_step=None) -> TrainResult:
        result = TrainResult()
        for _ in range(steps if steps is not None else self.config.steps - self.step):
            self.pmodel.train()
            metrics = self.train_step()
            result.steps.append(metrics)
            if on_step:
                on_step(metrics)
        return result


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
