"""Apply a ``ParallelPlan`` to a model, in torchtitan's order: PP split, then per chunk TP, EP, the
kernel plan, AC, compile per block, FSDP."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from adapt.core.errors import BadInput
from adapt.runtime.adapted import (
    AdaptedReport,
    AdaptOptions,
    apply_kernels,
    compile_blocks,
    enable_async_tp,
    local_row_modules,
)
from adapt.runtime.context_parallel import check_context_parallel
from adapt.runtime.data_parallel import apply_fully_shard
from adapt.runtime.expert_parallel import (
    ExpertParallelState,
    apply_expert_parallel,
)
from adapt.runtime.mesh import ParallelDims
from adapt.runtime.model_parts import (
    ModelParts,
    find_parts,
    head_geometry,
)
from adapt.runtime.pipeline import (
    build_schedule,
    capture_block_context,
    check_decomposition,
    split_stages,
)
from adapt.runtime.tensor_parallel import (
    apply_tensor_parallel,
    check_tensor_parallel,
    find_head_count_attributes,
)
from adapt.runtime.tied_weights import (
    TiedAcrossStages,
    tie_across_stages,
)
from operators.positions import derived_positions_in_training
from operators.recompute import checkpoint_blocks


@dataclass
class ParallelModel:
    """The realised model on this rank: one chunk, or several for interleaved pipelines."""

    dims: ParallelDims
    parts: ModelParts
    chunks: list[nn.Module]
    schedule: Any = None  # a torch.distributed.pipelining schedule when pp > 1
    stage_indices: tuple[int, ...] = (0,)
    experts: ExpertParallelState | None = None
    tied: TiedAcrossStages | None = None  # tied embedding/head split over pipeline stages
    adapted: AdaptedReport = dataclasses.field(default_factory=AdaptedReport)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return self.dims.plan.pp * self.dims.plan.vpp - 1 in self.stage_indices

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for chunk in self.chunks:
            for param in chunk.parameters():
                seen.setdefault(id(param), param)
        return list(seen.values())

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)


def _present(module: nn.Module, path: str | None) -> bool:
    if not path:
        return False
    try:
        return isinstance(module.get_submodule(path), nn.Module)
    except AttributeError:
        return False


def parts_in(module: nn.Module, parts: ModelParts) -> ModelParts:
    """``parts`` restricted to what a pipeline chunk still holds."""
    return dataclasses.replace(
        parts,
        blocks=[b for b in parts.blocks if _present(module, b.path)],
        embedding=parts.embedding if _present(module, parts.embedding) else "",
        final_norm=parts.final_norm if _present(module, parts.final_norm) else None,
        head=parts.head if _present(module, parts.head) else None,
    )


def broadcast_model_state(model: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers.  Random (config-only) initialisation
    and non-persistent buffers (rotary tables, absent from checkpoints) can differ per process;
    left alone, ranks would silently train different models."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    micro_batch_shape: tuple[int, int],
    loss_fn=None,
    spec: Any = None,
    adapt: AdaptOptions | None = None,
) -> ParallelModel:
    """Realise ``dims.plan`` on ``model`` (already on ``dims.device``, identical on every rank).

    ``adapt`` makes it the adapted model: the kernel plan and per-block compilation (``adapted``).
    """
    plan = dims.plan
    adapt = adapt or AdaptOptions()
    report = AdaptedReport()
    if plan.precision == "fp8":
        raise BadInput("fp8 training is not realised by the torch.distributed backend; use bf16 or fp32")
    broadcast_model_state(model)
    parts = find_parts(model, heads=head_geometry(model, spec))
    if plan.tp > 1:
        check_tensor_parallel(parts, plan.tp, plan.vocab_parallel)
        parts.head_count_attrs = find_head_count_attributes(model, parts, plan.tp)
    if plan.offload_optimizer and dims.device.type != "cuda":
        raise BadInput("offload_optimizer moves FSDP state from the GPU to host memory: it needs CUDA")
    if plan.cp > 1:
        check_context_parallel(
            dims.device,
            getattr(getattr(model, "config", None), "_attn_implementation", None),
        )
    if plan.pp > 1:
        probe = torch.randint(0, parts.vocab_size, micro_batch_shape, device=dims.device)
        context = capture_block_context(model, parts, probe)
        check_decomposition(model, parts, probe, context)
        stage_modules = split_stages(model, parts, plan, dims.pp_rank, context)
    else:
        stage_modules = [(0, model)]
    experts = None
    if plan.ep > 1:
        if plan.tp > 1 or plan.cp > 1:
            raise BadInput("expert parallelism together with tp or cp is not realised; combine ep with FSDP or PP")
        experts = ExpertParallelState(dims.ep_mesh, dims.expert_dp_mesh, dp_degree=plan.dp * plan.cp)
    if plan.tp > 1:
        report.async_tp = enable_async_tp(dims.mesh("tp"), dims.device, adapt, plan.sequence_parallel)
    for _, chunk in stage_modules:
        chunk_parts = parts_in(chunk, parts)
        if plan.tp > 1:
            apply_tensor_parallel(
                chunk,
                chunk_parts,
                dims.mesh("tp"),
                sequence_parallel=plan.sequence_parallel,
                vocab_parallel=plan.vocab_parallel,
                local_rows=local_row_modules(adapt.kernel_plan, plan, bool(adapt.compile)),
            )
        ignored: set[nn.Parameter] = set()
        if experts is not None:
            ignored = set(apply_expert_parallel(chunk, chunk_parts, experts))
        if adapt.kernel_plan is not None:
            apply_kernels(chunk, plan, adapt, dims.device, report)
        blocks = chunk.get_submodule(parts.blocks_path)
        checkpoint_blocks(blocks.children(), plan.recompute)
        if adapt.compile:
            compile_blocks(blocks, adapt.compile, report)
        if dims.dp_mesh is not None:
            apply_fully_shard(
                chunk,
                list(blocks.children()),
                dims.dp_mesh,
                zero=plan.zero,
                precision=plan.precision,
                offload=plan.offload_optimizer,
                ignored_params=ignored or None,
            )
    if plan.pp == 1:  # the one chunk is the whole model, whose forward prepares the causal mask
        derived_positions_in_training(stage_modules[0][1])  # (for the life of the run: no undo kept)
    result = ParallelModel(
        dims=dims,
        parts=parts,
        chunks=[m for _, m in stage_modules],
        stage_indices=tuple(s for s, _ in stage_modules),
        experts=experts,
        adapted=report,
    )
    if plan.pp > 1:
        result.tied = tie_across_stages(result.chunks, result.stage_indices, parts, dims)
        result.schedule, _ = build_schedule(stage_modules, plan, dims.mesh("pp"), dims.device, loss_fn)
    return result
