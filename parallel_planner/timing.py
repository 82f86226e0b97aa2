"""Step time of every candidate: compute, α–β communication, overlap and pipeline bubbles.

Compute: each GEMM costs ``max(FLOPs / (peak * ceiling * gemm), bytes / (HBM * memory_bw)) + launch``,
so small or skinny GEMMs (TP shards, experts with few tokens) fall off the roofline; flash attention
runs at its own fraction of peak; norms, activations and residuals are HBM-bound.  A calibration
(measured per-block times) rescales the compute of the block types it covers.  Communication:
TP all-gather/reduce-scatter (sequence parallel) and EP all-to-all sit on the critical path; CP's
ring exchange hides behind attention; ZeRO's gradient reduction and parameter gathers hide behind the
compute they can overlap with.  The pipeline runs ``m`` micro-batches at the slowest stage's pace plus
the fill/drain bubble of the remaining stages, divided by the virtual stages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from parallel_planner.cluster import Cluster
from parallel_planner.comms import Collectives, LinkModel
from parallel_planner.layout import RECOMPUTE, SCHEDULES, Candidates, StageLayout, row_max
from parallel_planner.memory import ACT_BYTES, micro_batches, stage_params
from parallel_planner.profile import BlockProfile, ModelProfile
from parallel_planner.workload import Workload

FULL = RECOMPUTE.index("full")
SELECTIVE = RECOMPUTE.index("selective")
ZERO_BUBBLE = SCHEDULES.index("zero_bubble")


@dataclass(frozen=True)
class Efficiency:
    """The time model's free parameters.

    ``gemm``, ``attention`` and ``network`` were fitted once, jointly, to every row of
    ``data/published_runs.csv`` (``python -m parallel_planner.published --fit``, least squares on the
    log of per-GPU throughput); the rest are fixed from common measurements.  See
    ``benchmarks/results/planner-published.md`` for the fit and its leave-one-source-out error.
    """

    gemm: float = 0.712  # fraction of the catalogue's large-GEMM ceiling a training framework sustains
    attention: float = 0.55  # flash-attention forward FLOP rate as a fraction of dense bf16 peak
    network: float = 0.783  # achieved fraction of link bandwidth (NCCL bus bandwidth / datasheet)
    memory_bw: float = 0.8  # achieved fraction of HBM bandwidth by elementwise kernels
    kernel_overhead_s: float = 4e-6  # launch and tail cost per kernel
    alpha_intra_s: float = 5e-6  # collective latency per step on the scale-up link
    alpha_inter_s: float = 15e-6  # ... across the network
    overlap: float = 0.8  # compute rate kept while a collective runs beside it
    overlap_grad_reduce: bool = True  # gradient reduction runs during the last backward (FSDP2/DDP buckets)
    cpu_adam_params_per_s: float = 5e8  # offloaded optimizer: host Adam throughput per GPU
    zero_bubble_fraction: float = 1 / 3  # ZB-H1 bubble relative to 1F1B's (weight-gradient work fills the rest)

    def link_model(self) -> LinkModel:
        return LinkModel(self.alpha_intra_s, self.alpha_inter_s, self.network)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def gemm_seconds(m, k, n, cluster: Cluster, peak: float, eff: Efficiency, count=1.0):
    """``count`` GEMMs of ``(m x k) @ (k x n)`` issued as one grouped kernel."""
    flops = 2.0 * m * k * n
    moved = ACT_BYTES * (m * k + k * n + m * n)
    rate = peak * cluster.gpu.gemm_ceiling * eff.gemm
    hbm = cluster.gpu.hbm_gbps * 1e9 * eff.memory_bw
    return count * np.maximum(flops / rate, moved / hbm) + eff.kernel_overhead_s


def block_forward_seconds(
    block: BlockProfile, tokens, tp, ep, context: float, cluster: Cluster, precision: str, eff: Efficiency,
    moe_imbalance: float = 1.0,
):
    """(GEMM, attention, elementwise) forward seconds of one block for ``tokens`` local tokens; the experts
    run at the pace of the busiest EP rank (``moe_imbalance`` times the mean routed tokens; one rank holding
    every expert has no imbalance to suffer)."""
    peak = cluster.gpu.peak_flops(precision)
    gemm = 0.0
    for g in block.gemms:
        shard = tp if g.tp_sharded else 1
        if g.routed:
            local_experts = block.num_experts / ep
            per_expert = tokens * block.top_k * ep / block.num_experts * np.where(ep > 1, moe_imbalance, 1.0)
            gemm = gemm + gemm_seconds(per_expert, g.in_features, g.out_features / shard, cluster, peak, eff, local_experts)
        else:
            gemm = gemm + gemm_seconds(tokens, g.in_features, g.out_features / shard, cluster, peak, eff)
    gemm = gemm * block.flops_scale
    bf16_peak = cluster.gpu.peak_flops("bf16")
    attention = tokens * context * block.attention_flops_per_ctx / tp / (bf16_peak * eff.attention)
    hbm = cluster.gpu.hbm_gbps * 1e9 * eff.memory_bw
    elementwise = ACT_BYTES * tokens * block.elementwise_width / tp / hbm + 8 * eff.kernel_overhead_s
    return gemm, attention, elementwise


def step_time(
    profile: ModelProfile,
    cluster: Cluster,
    workload: Workload,
    c: Candidates,
    layout: StageLayout,
    eff: Efficiency,
    compute_scale: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Seconds per optimizer step (inference: per forward batch) and its parts, one entry per candidate."""
    comm = Collectives(cluster, eff.link_model())
    n_types = len(profile.blocks)
    scale = np.ones(n_types) if compute_scale is None else compute_scale
    tokens = (c.mbs * workload.seq_len / c.cp).astype(np.float64)
    tp, ep, cp = c.tp, c.ep, c.cp
    h = profile.hidden
    full = c.recompute == FULL
    fwd = np.zeros((len(c), n_types))
    bwd = np.zeros_like(fwd)
    exposed_comm = np.zeros_like(fwd)
    for j, block in enumerate(profile.blocks):
        ctx = profile.attention_context(block, workload.seq_len)
        gemm, attention, elementwise = block_forward_seconds(
            block, tokens, tp, ep, ctx, cluster, workload.precision, eff, workload.moe_imbalance
        )
        f = scale[j] * (gemm + attention + elementwise)
        b = scale[j] * (2 * gemm + 2.5 * attention + 2 * elementwise)
        recompute = np.where(full, f, np.where(c.recompute == SELECTIVE, scale[j] * elementwise, 0.0))
        activation = ACT_BYTES * tokens * h
        tp_pairs = int(block.has_attention) + int(block.has_mlp)
        tp_fwd = tp_pairs * 2 * comm.all_gather(activation, tp, np.ones_like(tp))
        ep_fwd = 0.0
        if block.is_moe:
            ep_fwd = 2 * comm.all_to_all(activation * block.top_k * workload.moe_imbalance / tp, ep, tp)
        ring = (cp - 1) * comm.send_recv(ACT_BYTES * tokens * block.cp_exchange_width / tp, cp, tp)
        cp_fwd = np.maximum(0.0, ring - scale[j] * attention)
        cp_bwd = np.maximum(0.0, 2 * ring - scale[j] * 2.5 * attention)
        fwd[:, j] = f
        exposed_comm[:, j] = tp_fwd + ep_fwd + cp_fwd
        if workload.training:
            bwd[:, j] = b + recompute + (tp_fwd + ep_fwd) * (1 + full) + cp_bwd + cp_fwd * full
    counts = layout.type_counts.T  # (T, pp)
    head_fwd = gemm_seconds(tokens, h, profile.vocab / tp, cluster, cluster.gpu.peak_flops(workload.precision), eff)
    head_fwd = head_fwd + 3 * 4 * tokens * profile.vocab / tp / (cluster.gpu.hbm_gbps * 1e9 * eff.memory_bw)
    stage_fwd = (fwd + exposed_comm) @ counts + layout.has_head[None, :] * head_fwd[:, None]
    stage_bwd = bwd @ counts + layout.has_head[None, :] * (2 * head_fwd)[:, None] if workload.training else 0 * stage_fwd

    pp = c.pp
    passes = 2 if workload.training else 1
    p2p = passes * c.vpp * comm.send_recv(ACT_BYTES * tokens * h / tp, pp, c.dp * c.cp * tp)
    stage = stage_fwd + stage_bwd + p2p[:, None]
    m = micro_batches(workload, c).astype(np.float64)
    slowest = row_max(stage)
    bubble = (stage @ layout.multiplicity - slowest) / c.vpp
    bubble = np.where(c.schedule == ZERO_BUBBLE, bubble * eff.zero_bubble_fraction, bubble)
    pipeline = m * slowest + bubble

    out = {
        "pipeline": pipeline,
        "bubble": bubble,
        "compute_per_microbatch": row_max(fwd @ counts) + (row_max(bwd @ counts) if workload.training else 0),
        "exposed_comm_per_microbatch": row_max(exposed_comm @ counts) + p2p,
    }
    if workload.training:
        dp_exposed, optimizer = _data_parallel(profile, cluster, workload, c, layout, comm, eff, stage_fwd, stage_bwd, m)
        out["data_parallel_exposed"] = dp_exposed
        out["optimizer"] = optimizer
        out["step"] = pipeline + dp_exposed + optimizer
    else:
        out["step"] = pipeline
    out["hardware_flops_per_token"] = _hardware_flops_per_token(profile, workload, c)
    return out


def _data_parallel(profile, cluster, workload, c, layout, comm, eff, stage_fwd, stage_bwd, m):
    """Exposed ZeRO/DDP communication and the optimizer update, slowest stage."""
    dense, experts = stage_params(profile, layout)
    tp = c.tp[:, None].astype(np.float64)
    ep = c.ep[:, None].astype(np.float64)
    dense_gpu = dense[None, :] / tp
    expert_gpu = experts[None, :] / (tp * ep)
    shard = c.shard[:, None]
    expert_shard = shard // c.ep[:, None]
    stride = c.tp[:, None]
    has_experts = (experts > 0)[None, :]

    def per_gpu_params(kind, dense_group, expert_group):
        """Seconds of one collective over each stage's dense and routed-expert parameters, per byte-per-param
        coefficients computed once per candidate (collectives are affine in their size)."""
        a_d, b_d = comm.affine(kind, *dense_group)
        a_e, b_e = comm.affine(kind, *expert_group)
        return lambda bytes_per_param, dense_div=1, expert_div=1: (
            a_d + b_d * bytes_per_param / (tp * dense_div) * dense[None, :]
            + has_experts * a_e + b_e * bytes_per_param / (tp * ep * expert_div) * experts[None, :])

    within = per_gpu_params("reduce_scatter", (shard, stride), (expert_shard, stride * c.ep[:, None]))
    across = per_gpu_params("all_reduce", (c.replicate[:, None], stride * shard),
                            (c.replicate[:, None], stride * shard))
    gather = per_gpu_params("all_gather", (shard, stride), (expert_shard, stride * c.ep[:, None]))
    # One gradient sync: reduce-scatter inside the shard group, then (HSDP) all-reduce of the shard across
    # the replicas, the way FSDP2 reduces over a (dp_replicate, dp_shard) mesh.
    grads_rs = within(4) + across(4, shard, expert_shard)
    params_ag = gather(2)
    zero = c.zero[:, None]
    hide_bwd = eff.overlap * stage_bwd * eff.overlap_grad_reduce
    hide_fwd = eff.overlap * stage_fwd
    step_grad = np.where(zero == 0, 2 * grads_rs, np.where(zero == 1, grads_rs, 0.0))
    step_param = np.where((zero == 1) | (zero == 2), params_ag, 0.0)
    per_mb = np.where(zero == 2, grads_rs, np.where(zero == 3, 2 * params_ag + grads_rs, 0.0))
    # ZeRO-3 with offload keeps the weights on the host: every forward and backward copies them over PCIe.
    host_copies = 2 * 2 * (dense_gpu / shard + expert_gpu / expert_shard) / (cluster.gpu.pcie_gbps * 1e9)
    per_mb = per_mb + np.where((zero == 3) & (c.offload[:, None] > 0), host_copies, 0.0)
    exposed = (
        np.maximum(0.0, step_grad - hide_bwd)
        + np.maximum(0.0, step_param - hide_fwd)
        + m[:, None] * np.maximum(0.0, per_mb - eff.overlap * (stage_fwd + stage_bwd))
    )
    local = dense_gpu / np.where(zero >= 1, shard, 1) + expert_gpu / np.where(zero >= 1, expert_shard, 1)
    hbm = cluster.gpu.hbm_gbps * 1e9 * eff.memory_bw
    update = local * (18 + 2 * workload.optimizer_state_bytes) / hbm
    offloaded = local * 6 / (cluster.gpu.pcie_gbps * 1e9) + local / eff.cpu_adam_params_per_s
    optimizer = np.where(c.offload[:, None] > 0, offloaded, update)
    return row_max(exposed), row_max(optimizer)


def _hardware_flops_per_token(profile: ModelProfile, workload: Workload, c: Candidates) -> np.ndarray:
    """Model FLOPs plus what recompute adds (full: every block's forward once more)."""
    model = profile.model_flops_per_token(workload.seq_len, workload.training)
    if not workload.training:
        return np.full(len(c), model)
    block_forward = (model / 3) - profile.head_flops_per_token
    return model + np.where(c.recompute == FULL, block_forward, 0.0)
