"""DeviceMesh construction from a ``ParallelPlan``: one world mesh with named dimensions.

Dimensions are laid out outer-to-inner as ``pp, dp_replicate, dp_shard, cp, tp`` so that tensor
parallelism (the chattiest) stays inside a node.  Expert parallelism borrows the innermost ``ep``
ranks of ``dp_shard``: the same world is viewed a second time as ``pp, dp_replicate, dp_shard/ep,
ep, cp, tp``, so rank numbering agrees between the two meshes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from adapt.core.errors import BadInput
from parallel_planner.plan import ParallelPlan

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    """The realised meshes and this rank's coordinates in them."""

    plan: ParallelPlan
    world: DeviceMesh
    device: torch.device
    expert: DeviceMesh | None = None  # dims: pp, dp_replicate, efsdp, ep, cp, tp

    def mesh(self, name: str) -> DeviceMesh:
        return self.world[name]

    @cached_property
    def dp_mesh(self) -> DeviceMesh | None:
        """Mesh for FSDP: ``(dp_replicate, dp_shard)`` for HSDP, dp_shard (x cp, flattened) otherwise;
        ``None`` when there is nothing to shard and no mixed precision to apply."""
        plan = self.plan
        shard_dims = ("dp_shard", "cp") if plan.cp > 1 else ("dp_shard",)
        shard = self.world[shard_dims]._flatten("dp_shard_cp") if plan.cp > 1 else self.world["dp_shard"]
        if plan.dp_replicate > 1:
            if plan.cp > 1:
                raise BadInput("dp_replicate > 1 together with cp > 1 is not realised; fold replication into dp_shard")
            return self.world["dp_replicate", "dp_shard"]
        # bf16 needs FSDP's mixed-precision policy even without data parallelism: a 1-wide mesh.
        return shard if plan.dp_shard * plan.cp > 1 or plan.precision == "bf16" else None

    @property
    def dp_rank(self) -> int:
        """Index of this rank's slice of the global batch (ranks in one tp/cp/pp group share it)."""
        return (
            self.world["dp_replicate"].get_local_rank() * self.plan.dp_shard + self.world["dp_shard"].get_local_rank()
        )

    @property
    def pp_rank(self) -> int:
        return self.world["pp"].get_local_rank()

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        return self.expert["ep"] if self.expert is not None else None

    @cached_property
    def expert_dp_mesh(self) -> DeviceMesh | None:
        """Ranks that hold the same experts (expert data parallelism); ``None`` when there are none."""
        if self.expert is None or self.plan.dp_replicate * self.plan.dp_shard // self.plan.ep == 1:
            return None
        if self.plan.dp_replicate == 1:
            return self.expert["efsdp"]
        return self.expert["dp_replicate", "efsdp"]._flatten("expert_dp")


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_parallel_dims(plan: ParallelPlan, device: torch.device | None = None) -> ParallelDims:
    """Create the meshes for ``plan`` on the already-initialised default process group."""
    problems = plan.validate()
    if problems:
        raise BadInput("plan is inconsistent: " + "; ".join(problems))
    if not dist.is_initialized():
        raise BadInput("torch.distributed is not initialised: run under torchrun (see `adapt launch`)")
    world_size = dist.get_world_size()
    if world_size != plan.world_size:
        raise BadInput(f"plan needs world size {plan.world_size} (pp*dp*cp*tp) but {world_size} processes were started")
    device = device or default_device()
    shape = tuple(plan.mesh_shape()[name] for name in DIM_NAMES)
    world = init_device_mesh(device.type, shape, mesh_dim_names=DIM_NAMES)
    expert = None
    if plan.ep > 1:
        if plan.dp_shard % plan.ep:
            raise BadInput(f"ep={plan.ep} must divide dp_shard={plan.dp_shard}: experts borrow dp_shard ranks")
        expert_shape = (
            plan.pp,
            plan.dp_replicate,
            plan.dp_shard // plan.ep,
            plan.ep,
            plan.cp,
            plan.tp,
        )
        names = ("pp", "dp_replicate", "efsdp", "ep", "cp", "tp")
        expert = DeviceMesh(
            device.type,
            torch.arange(world_size).view(expert_shape),
            mesh_dim_names=names,
        )
    return ParallelDims(plan=plan, world=world, device=device, expert=expert)
