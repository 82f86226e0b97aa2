"""``adapt launch SOURCE --plan PLAN.json``: print (or run) the torchrun command for ``adapt train``."""

from __future__ import annotations

import argparse
import json
import subprocess

from adapt.app.commands.flags import add_json
from adapt.app.commands.train import _plan, add_train_arguments


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "launch",
        help="print or execute the torchrun command that trains under a plan, on one node or many",
        description="Multi-node: run the printed command on every node with the same --rdzv-endpoint.",
    )
    add_train_arguments(p)
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        help="processes per node (default: plan world size / nnodes)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        help="HOST:PORT of the c10d rendezvous (required for --nnodes > 1)",
    )
    p.add_argument(
        "--rdzv-id",
        default="adapt",
        help="rendezvous id shared by all nodes of one job",
    )
    p.add_argument("--execute", action="store_true", help="run the command instead of printing it")
    add_json(p, "the command (as an argument list and as shell text)")
    p.set_defaults(func=handler)


_LAUNCH_ONLY = {
    "nnodes",
    "nproc_per_node",
    "rdzv_endpoint",
    "rdzv_id",
    "execute",
    "json",
    "func",
    "command",
}


def _train_args(args: argparse.Namespace) -> list[str]:
    out = [args.source]
    for key, value in vars(args).items():
        if key in _LAUNCH_ONLY or key == "source" or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def handler(args: argparse.Namespace) -> int:
    from parallel_planner.launch import (
        LaunchConfig,
        render,
        torchrun_command,
    )

    plan = _plan(args.plan)
    launch = LaunchConfig(
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
    )
    cmd = torchrun_command(plan, launch, _train_args(args))
    if args.json and not args.execute:
        print(json.dumps({"command": cmd, "text": render(cmd)}))
        return 0
    if not args.execute:
        print(render(cmd))
        return 0
    return subprocess.call(cmd)
