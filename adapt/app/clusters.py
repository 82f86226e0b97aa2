"""``--cluster`` to a planner ``Cluster`` for every command: the planner parses ``NxGPU`` and cluster files, and
``local`` is this machine as the environment validator measures it.  Measuring belongs to the validators, planning to
the planner; this app-level joint is the one place that composes the two."""

from __future__ import annotations

from typing import Any


def local_cluster(device: str | None = None) -> Any:
    """This machine, measured by the environment validator (GPUs, their count, bf16 matmul rate, bandwidth)."""
    from parallel_planner.cluster import cluster_from_environment
    from validators.environment import check_environment

    # bf16 matmul: the measured rate becomes the GEMM ceiling against the catalogue's bf16 peak
    return cluster_from_environment(check_environment(precision="bf16", device=device, measure=True).to_dict())


def target_cluster(text: str) -> Any:
    """``8xH100`` (count x catalogue GPU), a cluster YAML/TOML file, or ``local`` (this machine, measured)."""
    from parallel_planner.cluster import parse_cluster_option

    return parse_cluster_option(text) or local_cluster()
