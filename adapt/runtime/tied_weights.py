"""A tied input embedding and output head split across pipeline stages (Megatron's shared embedding).

With ``pp > 1`` the embedding sits on the first stage and the head on the last, so the one tied
matrix exists twice: once on each of those ranks, identical at the start because every rank loads
the same checkpoint (``broadcast_model_state``).  The true gradient is the sum of the embedding's and
the head's, so after each backward the two copies' gradients are all-reduced over a two-rank group
(first and last stage of the same pipeline); both copies then take the same optimizer step and stay
equal.  The gradient norm counts the matrix once (on the first stage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from adapt.runtime.mesh import DIM_NAMES, ParallelDims


@dataclass
class TiedAcrossStages:
    param: nn.Parameter  # this rank's copy: the embedding table (first stage) or the head weight (last)
    group: dist.ProcessGroup
    counted_in_norm: bool  # False on the last stage: after the sum its gradient equals the first stage's

    @torch.no_grad()
    def sync_grads(self) -> None:
        grad = self.param.grad
        if grad is None:
            raise RuntimeError("tied embedding/head copy has no gradient after backward")
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=self.group)


def _pipeline_end_pairs(dims: ParallelDims) -> list[list[int]]:
    """(first-stage rank, last-stage rank) of every pipeline in the world mesh, in one global order."""
    ranks = dims.world.mesh
    pp_axis = DIM_NAMES.index("pp")
    lines = ranks.movedim(pp_axis, -1).reshape(-1, ranks.shape[pp_axis])
    return [[int(line[0]), int(line[-1])] for line in lines]


def tie_across_stages(
    chunks: list[nn.Module], stage_indices: tuple[int, ...], parts, dims: ParallelDims
) -> TiedAcrossStages | None:
    """Set up the gradient sum for a tied model split over ``pp > 1`` ranks; ``None`` when not needed.

    Every rank must call this (group creation is collective), whichever stages it holds.
    """
    num_stages = dims.plan.pp * dims.plan.vpp
    if not parts.tied or num_stages < 2 or not parts.embedding or not parts.head:
        return None
    mine = None
    me = dist.get_rank()
    for pair in _pipeline_end_pairs(dims):
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    param = None
    first = 0 in stage_indices
    for stage, chunk in zip(stage_indices, chunks):
        if stage == 0:
            param = chunk.get_submodule(parts.embedding).weight
        elif stage == num_stages - 1:
            param = chunk.get_submodule(parts.head).weight
    if param is None:  # a middle stage: holds neither copy
        return None
    return TiedAcrossStages(param, mine, counted_in_norm=first)
