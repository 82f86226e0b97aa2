"""Data-parallel time of a step: the exposed gradient reductions and parameter gathers, and the optimizer update.

ZeRO/FSDP collectives hide behind the compute they can overlap with, but for the first gather and last
reduction of a pass; FSDP2's casts and copies run on every mesh; DeepSpeed's pipeline engine reduces after the
flush, all-reduces its tied embedding's fp32 gradient between the end stages and gathers the updated weights
inside the optimizer step.  ``docs/planner-model.md`` states every term and its source.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from parallel_planner.cluster import Cluster
from parallel_planner.comms import Collectives
from parallel_planner.layout import SCHEDULES, Candidates, StageLayout, mirrored, row_max
from parallel_planner.memory import stage_params
from parallel_planner.profile import ModelProfile
from parallel_planner.runtimes import DEEPSPEED_PIPE, DS_BF16_STEP_BYTES, grad_reduce_bytes


class Efficiency(Protocol):
    """What these terms read of ``efficiency.Efficiency``: any object with these fields will do."""

    overlap: float
    memory_bw: float
    runtime: str
    grads16: bool


GRAD_CLIP_BYTES = 12  # per local parameter: fp32 gradient read for the norm, then read and written to scale it


def data_parallel_seconds(profile, cluster, workload, c, layout, comm, eff, stage_fwd, stage_bwd, m):
    """Exposed ZeRO/DDP communication and the optimizer update, slowest stage."""
    stage_dense, stage_experts = stage_params(profile, layout)
    dual = c.schedule == SCHEDULES.index("dualpipe")  # a DualPipe device holds two stages
    dense, experts = mirrored(stage_dense, dual, mean=False), mirrored(stage_experts, dual, mean=False)
    tp = c.tp[:, None].astype(np.float64)
    ep = c.ep[:, None].astype(np.float64)
    dense_gpu = dense / tp
    expert_gpu = experts / (tp * ep)
    shard = c.shard[:, None]
    expert_shard = shard // c.ep[:, None]
    stride = c.tp[:, None]
    has_experts = experts > 0

    def per_gpu_params(kind, dense_group, expert_group):
        """Seconds of one collective over each stage's dense and routed-expert parameters, per byte-per-param
        coefficients computed once per candidate (collectives are affine in their size)."""
        a_d, b_d = comm.affine(kind, *dense_group)
        a_e, b_e = comm.affine(kind, *expert_group)
        return lambda bytes_per_param, dense_div=1, expert_div=1: (
            a_d
            + b_d * bytes_per_param / (tp * dense_div) * dense
            + has_experts * a_e
            + b_e * bytes_per_param / (tp * ep * expert_div) * experts
        )

    within = per_gpu_params("reduce_scatter", (shard, stride), (expert_shard, stride * c.ep[:, None]))
    across = per_gpu_params(
        "all_reduce", (c.replicate[:, None], stride * shard), (c.replicate[:, None], stride * shard)
    )
    gather = per_gpu_params("all_gather", (shard, stride), (expert_shard, stride * c.ep[:, None]))
    # One gradient sync: reduce-scatter inside the shard group, then (HSDP) all-reduce of the shard across
    # the replicas, the way FSDP2 reduces over a (dp_replicate, dp_shard) mesh; fp32 gradients unless the run
    # keeps them 16-bit or reduces in bf16 (runtimes.grad_reduce_bytes).
    g = grad_reduce_bytes(eff)
    grads_rs = within(g) + across(g, shard, expert_shard)
    params_ag = gather(2)
    zero = c.zero[:, None]
    deepspeed = eff.runtime == DEEPSPEED_PIPE
    # DeepSpeed's pipeline engine reduces after the flush and gathers the updated bf16 weights inside the
    # optimizer step: neither overlaps with compute.  Its bf16 optimizer's ZeRO-1 all-reduces the gradients.
    hide_bwd = eff.overlap * stage_bwd * (c.grad_overlap[:, None] > 0) * (not deepspeed)
    hide_fwd = eff.overlap * stage_fwd * (not deepspeed)
    step_grad = np.where((zero == 0) | ((zero == 1) & deepspeed), 2 * grads_rs, np.where(zero == 1, grads_rs, 0.0))
    step_param = np.where((zero == 1) | (zero == 2), params_ag, 0.0)
    per_mb = np.where(zero == 2, grads_rs, np.where(zero == 3, 2 * params_ag + grads_rs, 0.0))
    # ZeRO-3 with offload keeps the weights on the host: every forward and backward copies them over PCIe.
    host_copies = 2 * 2 * (dense_gpu / shard + expert_gpu / expert_shard) / (cluster.gpu.pcie_gbps * 1e9)
    per_mb = per_mb + np.where((zero == 3) & (c.offload[:, None] > 0), host_copies, 0.0)
    # What compute cannot cover stays exposed; what it covers still slows it by the SMs NCCL takes.  The
    # first gather of a pass and the last reduction have no compute left beside them: under FSDP2 (torch)
    # those are the root's (embedding, final norm, head) and one block's parameter groups, by their sizes;
    # Megatron's buckets are about a block's size each.
    edge = 1.0 / (layout.type_counts.sum(axis=1)[None, :] + 1)
    if eff.runtime == "torch":
        edge = _fsdp2_edge(profile, layout, stage_dense, stage_experts)[None, :]
    exposed = (
        _exposed(step_grad, hide_bwd, eff, edge)
        + _exposed(step_param, hide_fwd, eff, edge)
        + m[:, None] * _exposed(per_mb, eff.overlap * (stage_fwd + stage_bwd), eff, edge)
    )
    if eff.runtime == "torch":
        exposed = exposed + _fsdp2_copies(
            dense_gpu + expert_gpu, shard, zero, m[:, None], (c.pp > 1)[:, None], cluster, eff
        )
    if deepspeed and profile.tied:
        exposed = exposed + _tied_reduction(profile, layout, c, comm)
    local = dense_gpu / np.where(zero >= 1, shard, 1) + expert_gpu / np.where(zero >= 1, expert_shard, 1)
    hbm = cluster.gpu.hbm_gbps * 1e9 * eff.memory_bw
    # Adam streams 18 + 2 x state bytes per local parameter; clipping the gradient norm (adapt's trainer and
    # Megatron-LM both clip) reads the fp32 gradients once for the norm and scales them (read + write).
    # DeepSpeed's bf16 optimizer norms, clips, casts and zeroes the whole stage's fp32 gradients instead.
    clip = np.where(deepspeed, DS_BF16_STEP_BYTES * (dense_gpu + expert_gpu), GRAD_CLIP_BYTES * local)
    update = (local * (18 + 2 * workload.optimizer_state_bytes) + clip) / hbm
    offloaded = local * 6 / (cluster.gpu.pcie_gbps * 1e9) + local / eff.cpu_adam_params_per_s
    optimizer = np.where(c.offload[:, None] > 0, offloaded, update)
    return row_max(exposed), row_max(optimizer)


def _tied_reduction(profile: ModelProfile, layout: StageLayout, c: Candidates, comm: Collectives) -> np.ndarray:
    """Seconds the first and last stage spend all-reducing the tied embedding's gradient between them, (C,
    stages): DeepSpeed's ``_exec_reduce_tied_grads`` all-reduces its fp32 copy (``weight._hp_grad`` under the
    bf16 optimizer) over the two stages' ranks after the flush, before the data-parallel reduction."""
    nbytes = 4.0 * profile.vocab * profile.hidden / c.tp
    apart = (c.pp - 1) * c.dp * c.cp * c.tp  # stage 0 and stage pp-1 hold the same TP and DP coordinates
    seconds = np.where(c.pp > 1, comm.time("all_reduce", nbytes, np.full(len(c), 2), np.maximum(apart, 1)), 0.0)
    ends = (layout.has_embedding + layout.has_head) > 0
    return seconds[:, None] * ends[None, :]


def _fsdp2_copies(params, shard, zero, m, pipelined, cluster: Cluster, eff: Efficiency) -> np.ndarray:
    """HBM seconds of FSDP2's own copies, which adapt's bf16 runs pay on any mesh (a 1-wide one included:
    the mixed-precision policy needs FSDP2).  Each unshard casts the fp32 shard to bf16 (read 4 + write 2
    bytes per sharded parameter) and copies the gathered bf16 buffer into the parameters (2 + 2 bytes per
    parameter); each reduction copies the bf16 gradients into the fp32 reduce buffer (2 + 4), and on a
    1-wide mesh, with no collective to write the output, copies that buffer into it (4 + 4).  Unshards per
    step: ZeRO-3 reshards after forward (two per micro-batch), ZeRO-2 after backward (one per micro-batch),
    ZeRO-0/1 keep the parameters across micro-batches (one); reductions: per micro-batch from ZeRO-2.
    ``torch.distributed.pipelining`` turns off resharding after backward and gradient sync on all but the
    last micro-batch: a ZeRO-3 stage gathers once per micro-batch (its backward; the next forward finds
    the parameters whole) plus once, and reduces once per step."""
    shard = shard.astype(np.float64)
    gathers = np.where(zero == 3, 2 * m, np.where(zero == 2, m, 1.0))
    reductions = np.where(zero >= 2, m, 1.0)
    gathers = np.where(pipelined, np.where(zero == 3, m + 1, 1.0), gathers)
    reductions = np.where(pipelined, 1.0, reductions)
    per_param = gathers * (4 + 6 / shard) + reductions * (6 + 8 * (shard == 1))
    return per_param * params / (cluster.gpu.hbm_gbps * 1e9 * eff.memory_bw)


def _fsdp2_edge(profile: ModelProfile, layout: StageLayout, dense: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """Share of each stage's parameters in its first gather and last reduction: the root group (embedding,
    final norm, head, on the stages that hold them) and the largest block group."""
    block_params = np.array([b.dense_params + b.expert_params for b in profile.blocks], dtype=np.float64)
    own = layout.type_counts @ np.array([b.dense_params for b in profile.blocks], dtype=np.float64)
    root = dense - own  # embedding and head on the stage
    largest = np.max(np.where(layout.type_counts > 0, block_params[None, :], 0.0), axis=1)
    return np.minimum(1.0, (root + largest) / np.maximum(dense + experts, 1.0))


def _exposed(comm: np.ndarray, hidden_by: np.ndarray, eff: Efficiency, edge=0.0) -> np.ndarray:
    """Seconds a collective adds beside ``hidden_by`` seconds of overlappable compute; the ``edge`` share
    of it runs where there is nothing to overlap with."""
    hideable = comm * (1 - edge)
    return np.maximum(0.0, hideable - hidden_by) + (1 - eff.overlap) * np.minimum(hideable, hidden_by) + comm * edge
