"""The torchrun command line for a plan: single node (``--standalone``) or multi-node (c10d rendezvous)."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

from adapt.core.errors import BadInput
from parallel_planner.plan import ParallelPlan


@dataclass
class LaunchConfig:
    nnodes: int = 1
    nproc_per_node: int | None = None  # default: the plan's world size spread evenly over the nodes
    rdzv_endpoint: str | None = None  # host:port of the c10d rendezvous, required when nnodes > 1
    rdzv_id: str = "adapt"
    max_restarts: int = 0


def procs_per_node(plan: ParallelPlan, launch: LaunchConfig) -> int:
    if launch.nnodes < 1:
        raise BadInput("--nnodes must be >= 1")
    per_node = launch.nproc_per_node or plan.world_size // launch.nnodes
    if per_node < 1 or per_node * launch.nnodes != plan.world_size:
        raise BadInput(
            f"the plan needs {plan.world_size} processes, which {launch.nnodes} node(s) x {per_node} per node does not give"
        )
    return per_node


def torchrun_command(plan: ParallelPlan, launch: LaunchConfig, train_args: list[str]) -> list[str]:
    """``python -m torch.distributed.run ... -m adapt train ...``: the same command on every node."""
    per_node = procs_per_node(plan, launch)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={per_node}",
        f"--nnodes={launch.nnodes}",
    ]
    if launch.nnodes == 1 and not launch.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        if not launch.rdzv_endpoint:
            raise BadInput("multi-node launch needs --rdzv-endpoint HOST:PORT (a host every node can reach)")
        if ":" not in launch.rdzv_endpoint:
            raise BadInput(f"--rdzv-endpoint {launch.rdzv_endpoint!r} must be HOST:PORT")
        cmd += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={launch.rdzv_endpoint}",
            f"--rdzv-id={launch.rdzv_id}",
        ]
    cmd += [
        f"--max-restarts={launch.max_restarts}",
        "-m",
        "adapt",
        "train",
        *train_args,
    ]
    return cmd


def render(cmd: list[str]) -> str:
    return shlex.join(cmd)


def launch_command(plan: ParallelPlan, gpus_per_node: int, source: str) -> str:
    """The command ``adapt launch`` would print for this plan (``plan.json`` = this answer, saved)."""
    nodes = max(1, plan.world_size // gpus_per_node)
    launch = LaunchConfig(nnodes=nodes, rdzv_endpoint="HEAD_NODE:29500" if nodes > 1 else None)
    return render(torchrun_command(plan, launch, [source, "--plan", "plan.json"]))
