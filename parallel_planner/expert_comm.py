"""The MoE all-to-all of expert parallelism: how many bytes cross which link, and how much of it compute hides.

A flat all-to-all (NCCL, Megatron's all-to-all dispatcher) sends one copy of a token per routed expert; DeepEP's
normal kernels (DeepSeek-V3 sec. 3.2.2) send it over the network once per target node and forward it over NVLink,
and group-limited routing bounds those nodes.  With EP overlap (DualPipe, Megatron-Core's combined 1F1B) the
all-to-all of one micro-batch runs beside another's forward and backward.  ``docs/planner-model.md`` cites each.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from parallel_planner.comms import Collectives
from parallel_planner.memory import ACT_BYTES, FP8_BYTES
from parallel_planner.profile import BlockProfile


class Efficiency(Protocol):
    """What these terms read of ``efficiency.Efficiency``: any object with these fields will do."""

    ep_forwarded: bool
    ep_fp8_dispatch: bool


def nodes_reached(block: BlockProfile, ep, tp, gpus_per_node: int) -> np.ndarray:
    """Nodes of the EP group a token's experts can sit on, at most: its top-k, bounded by group-limited routing
    when the experts' groups line up with nodes (experts lie contiguously over the EP ranks, so a node holds whole
    groups, or a group whole nodes).  DeepSeek-V3: 8 groups over EP64's 8 nodes, a token's from 4 (sec. 2.1.2)."""
    local = np.clip(gpus_per_node // np.maximum(tp, 1), 1, ep)
    nodes = np.ceil(ep / local)
    reach = nodes.astype(np.float64)
    groups, picked = block.expert_groups, block.groups_per_token
    if 1 < groups and picked < groups:
        whole_groups = groups % nodes == 0
        whole_nodes = nodes % groups == 0
        limit = np.where(whole_groups, picked, np.where(whole_nodes, picked * nodes / groups, nodes))
        reach = np.minimum(reach, limit)
    return np.minimum(reach, block.top_k)


def expert_all_to_all_seconds(
    block: BlockProfile, tokens, tp, ep, comm: Collectives, gpus_per_node: int, imbalance: float, eff: Efficiency
):
    """One pass's MoE dispatch and combine (forward; backward runs their mirrors with the same bytes) at the
    busiest EP rank: per routed copy the TP share of a token, bf16, or fp8 with a 4-byte scale per 128 elements
    for the dispatch when the run quantises before it (DeepSeek-V3 sec. 3.3.3: dispatch and the gradient before
    the down-projection in fp8, combine in bf16).  Flat: one copy per routed expert through NCCL's all-to-all;
    forwarded: once per target node over the network, then NVLink (``Collectives.forwarded_all_to_all``)."""
    if not block.is_moe:
        return np.zeros(len(ep))
    elements = tokens * block.hidden * imbalance / tp
    total = np.zeros(len(ep))
    for width in (FP8_BYTES if eff.ep_fp8_dispatch else ACT_BYTES, ACT_BYTES):
        if eff.ep_forwarded:
            reach = nodes_reached(block, ep, tp, gpus_per_node)
            total = total + comm.forwarded_all_to_all(width * elements, block.top_k, reach, ep, tp)
        else:
            total = total + comm.all_to_all(width * elements * block.top_k, ep, tp)
    return total


def exposed_all_to_all(one_pass, work, full, overlapped, overlap: float) -> np.ndarray:
    """Seconds of one pass's all-to-all left on the critical path.  Overlapped, the all-to-all of a micro-batch's
    forward, backward (and recomputed forward) runs beside another micro-batch's work on this block (``work``:
    its forward, backward and recompute): what ``overlap x work`` cannot cover stays exposed, and the covered
    part slows the compute by the SMs the communication takes, as for TP overlap."""
    passes = 2 + full
    total = passes * one_pass
    hidden = np.maximum(0.0, total - overlap * work) + (1 - overlap) * np.minimum(total, work)
    return np.where(overlapped > 0, hidden / passes, one_pass)
