"""Pipeline parallelism with ``torch.distributed.pipelining``: blocks split into stages as the plan says.

Each (virtual) stage is the HF model itself with the blocks of other stages removed (the block
list becomes a ``ModuleDict`` keyed by the original indices, so parameter names stay the HF
names) and the embedding / final norm / head kept only on the first / last stage.  A stage runs
``embed? -> its blocks -> norm? -> head?``.  The per-block context HF computes in its model
forward (rotary tables, masks, position ids) depends only on the sequence shape; it is captured
once from the full model and replayed.  Before splitting, that decomposition is checked
numerically against the model's own forward, so a model that does extra work between its parts
(e.g. scaled embeddings) is refused rather than silently mis-split.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from adapt.core.errors import BadInput
from adapt.runtime.model_parts import ModelParts, forward_with_hooks
from parallel_planner.plan import ParallelPlan


@dataclass
class BlockContext:
    """What the model forward passes to each block besides the hidden stream."""

    args: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    kwargs: dict[int, dict[str, Any]] = field(default_factory=dict)


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value


def capture_block_context(model: nn.Module, parts: ModelParts, input_ids: torch.Tensor) -> BlockContext:
    blocks = model.get_submodule(parts.blocks_path)
    context = BlockContext()
    handles = []
    for index, block in enumerate(blocks):

        def hook(module, args, kwargs, index=index):
            context.args[index] = _detach(tuple(args[1:]))
            context.kwargs[index] = {k: _detach(v) for k, v in kwargs.items()}

        handles.append(block.register_forward_pre_hook(hook, with_kwargs=True))
    forward_with_hooks(model, input_ids, handles)
    return context


def logits_of(output: Any, model: nn.Module | None = None) -> torch.Tensor:
    """Logits from a model output.  Encoders carry no LM head: their last hidden states are read out
    through the input embedding (a tied readout), so training still exercises every parameter with a
    token-level objective."""
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, torch.Tensor):
        return output
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None or model is None:
        raise TypeError(f"{type(output).__name__} holds neither logits nor last hidden states")
    weight = model.get_input_embeddings().weight
    if hasattr(weight, "full_tensor"):  # sharded (DTensor) embedding: gather it, differentiably
        weight = weight.full_tensor()
    return torch.nn.functional.linear(hidden, weight)


@dataclass
class StageModules:
    """The modules one pipeline stage runs, by path: its blocks and, on the end stages, embedding, norm, head."""

    embedding: str | None
    blocks_path: str
    block_keys: list[str]
    final_norm: str | None
    head: str | None


def _stage_forward(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    layout: StageModules = self._adapt_stage_layout
    context: BlockContext = self._adapt_block_context
    if layout.embedding:
        hidden = self.get_submodule(layout.embedding)(hidden)
    blocks = self.get_submodule(layout.blocks_path)
    for key in layout.block_keys:
        block = blocks[key] if isinstance(blocks, nn.ModuleDict) else blocks[int(key)]
        out = block(hidden, *context.args[int(key)], **context.kwargs[int(key)])
        hidden = out[0] if isinstance(out, tuple) else out
    if layout.final_norm:
        hidden = self.get_submodule(layout.final_norm)(hidden)
    if layout.head:
        hidden = self.get_submodule(layout.head)(hidden)
    return hidden


def check_decomposition(model: nn.Module, parts: ModelParts, input_ids: torch.Tensor, context: BlockContext) -> None:
    """Refuse to split a model whose forward is not embed -> blocks -> norm -> head.

    The head weight is scaled up for the check so that logits are large: a transform after the
    head (e.g. tanh soft-capping) is near-identity on the small logits of a fresh model and would
    otherwise pass unnoticed.
    """
    if parts.head is None:
        raise BadInput("pipeline parallelism needs an output head on the last stage; none was found")
    layout = StageModules(
        parts.embedding,
        parts.blocks_path,
        [str(i) for i in range(len(parts.blocks))],
        parts.final_norm,
        parts.head,
    )
    probe = types.SimpleNamespace(
        _adapt_stage_layout=layout,
        _adapt_block_context=context,
        get_submodule=model.get_submodule,
    )
    head_weight = model.get_submodule(parts.head).weight
    saved = head_weight.detach().clone()
    with torch.no_grad():
        try:
            head_weight.mul_(64.0 / max(float(saved.abs().max()), 1e-6))
            expected = logits_of(model(input_ids=input_ids, use_cache=False))
            got = _stage_forward(probe, input_ids)  # type: ignore[arg-type]
        finally:
            head_weight.copy_(saved)
    if got.shape != expected.shape or not torch.allclose(got.float(), expected.float(), rtol=1e-4, atol=1e-3):
        raise BadInput("pipeline split refused: the model's forward does more than embed -> blocks -> norm -> head")


def stage_block_counts(plan: ParallelPlan, num_blocks: int) -> list[int]:
    stages = plan.pp * plan.vpp
    if plan.stage_layers:
        if sum(plan.stage_layers) != num_blocks:
            raise BadInput(f"plan.stage_layers sums to {sum(plan.stage_layers)} but the model has {num_blocks} blocks")
        return list(plan.stage_layers)
    if num_blocks < stages:
        raise BadInput(f"{num_blocks} blocks cannot fill pp*vpp={stages} stages")
    base, extra = divmod(num_blocks, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def _set_child(model: nn.Module, path: str, value: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, value)


def split_stages(
    model: nn.Module,
    parts: ModelParts,
    plan: ParallelPlan,
    pp_rank: int,
    context: BlockContext,
) -> list[tuple[int, nn.Module]]:
    """This rank's ``(stage_index, module)`` pairs; stage s lives on rank ``s % pp`` (looped for interleaving)."""
    counts = stage_block_counts(plan, len(parts.blocks))
    num_stages = len(counts)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    mine = [s for s in range(num_stages) if s % plan.pp == pp_rank]
    stages = []
    for s in mine:
        module = copy.deepcopy(model) if len(mine) > 1 else model
        blocks = module.get_submodule(parts.blocks_path)
        keep = range(starts[s], starts[s] + counts[s])
        _set_child(module, parts.blocks_path, nn.ModuleDict({str(i): blocks[i] for i in keep}))
        first, last = s == 0, s == num_stages - 1
        if not first:
            _set_child(module, parts.embedding, None)
        if not last:
            for path in (parts.final_norm, parts.head):
                if path:
                    _set_child(module, path, None)
        module._adapt_stage_layout = StageModules(
            parts.embedding if first else None,
            parts.blocks_path,
            [str(i) for i in keep],
            parts.final_norm if last else None,
            parts.head if last else None,
        )
        module._adapt_block_context = context
        module.forward = types.MethodType(_stage_forward, module)
        stages.append((s, module))
    return stages


def build_schedule(
    stage_modules: list[tuple[int, nn.Module]],
    plan: ParallelPlan,
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn,
) -> tuple[Any, list[PipelineStage]]:
    if plan.pp_schedule == "dualpipe":
        raise BadInput(
            "schedule dualpipe is planned but not run by adapt's trainer: torch's ScheduleDualPipeV needs each rank "
            "to hold two stages placed in a V (rank r: stages r and 2*pp-1-r), which the stage builder does not "
            "lay out yet; train with --fixed schedule=1f1b (or interleaved_1f1b with vpp > 1)"
        )
    num_stages = plan.pp * plan.vpp
    stages = [PipelineStage(m, s, num_stages, device, group=pp_mesh.get_group()) for s, m in stage_modules]
    n_micro = plan.grad_accum
    if plan.vpp > 1:
        multi = {
            "interleaved_1f1b": ScheduleInterleaved1F1B,
            "zero_bubble": ScheduleInterleavedZeroBubble,
        }
        if plan.pp_schedule not in multi:
            raise BadInput(
                f"vpp={plan.vpp} needs an interleaved schedule (interleaved_1f1b, zero_bubble), not {plan.pp_schedule}"
            )
        schedule: PipelineScheduleMulti = multi[plan.pp_schedule](stages, n_microbatches=n_micro, loss_fn=loss_fn)
        return schedule, stages
    single = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
    if plan.pp_schedule not in single:
        raise BadInput(f"schedule {plan.pp_schedule} needs vpp > 1 (several stages per rank)")
    one: PipelineScheduleSingle = single[plan.pp_schedule](stages[0], n_microbatches=n_micro, loss_fn=loss_fn)
    return one, stages
