"""Step time of every candidate: compute, host issue time, alpha-beta communication, overlap, bubbles.

Every term is physical and nothing is fitted to a source; ``docs/planner-model.md`` states each term and
where its number comes from.  Compute: each GEMM costs ``max(FLOPs / (peak * ceiling * wave),
bytes / (HBM * memory_bw)) + launch`` (the catalogue's sustained GEMM ceiling, the idle SMs of a partial
last wave, or HBM-bound when skinny); attention runs at its kernel's measured fraction of peak by head dim
(or, unfused, the whole square plus score traffic); norms, activations and residuals are HBM-bound, more so
as eager modules.  Host: every operator a micro-batch issues costs the CPU a measured dispatch time
(eager, DTensor, compiled), FSDP2's hooks' own operators among them; the slower of host and GPU sets the
pace, and a layout whose host time exceeds its GPU time is host-bound.  Communication: TP collectives (SP or not, overlapped with GEMMs
or not) and the EP all-to-all (flat or forwarded per node, or beside another micro-batch's compute:
``expert_comm``) sit on the critical path; CP's ring exchange hides behind attention but for
its last gradient exchange, and torch's ring adds its own fp32 merges and host operators; ZeRO's gradient
reduction (overlapped with backward or after the flush) and parameter gathers hide behind the compute
they can overlap with, but for the first gather and last reduction; FSDP2's casts and copies run on
every mesh.  The pipeline runs ``m`` micro-batches at the slowest stage's pace plus
the fill/drain bubble of the remaining stages, divided by the virtual stages (DualPipe: pairs of mirrored
stages and its own bubble).  A calibration replaces
the GEMM ceiling and dispatch costs with measurements and scales compute to measured steps.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from parallel_planner.cluster import Cluster
from parallel_planner.comms import Collectives
from parallel_planner.data_parallel_time import data_parallel_seconds
from parallel_planner.efficiency import Efficiency
from parallel_planner.expert_comm import expert_all_to_all_seconds, exposed_all_to_all
from parallel_planner.kernel_rates import (
    attention_dropout_seconds,
    attention_seconds,
    elementwise_bytes_per_s,
    fp8_cast_seconds,
    gemm_peak,
    gemm_seconds,
    hidden_dropout_seconds,
    loss_seconds,
    routed_rows,
    score_bias_seconds,
    slowest_gpu_pace,
)
from parallel_planner.layout import (
    RECOMPUTE,
    SCHEDULES,
    Candidates,
    StageLayout,
    mirrored,
    row_max,
)
from parallel_planner.memory import ACT_BYTES, micro_batches, stage_params
from parallel_planner.profile import KERNEL_SHARE, BlockProfile, ModelProfile
from parallel_planner.runtimes import (
    TP_GATHERS,
    fsdp2_host_ops,
    grad_accum_bytes,
    p2p_seconds,
)
from parallel_planner.workload import Workload

FULL = RECOMPUTE.index("full")
SELECTIVE = RECOMPUTE.index("selective")
ZERO_BUBBLE = SCHEDULES.index("zero_bubble")
DUALPIPE = SCHEDULES.index("dualpipe")
HEAD_OPS = 40  # embedding lookup, final norm, head GEMM and cross-entropy, forward and backward


# torch's ring attention (torch.distributed.tensor.experimental.context_parallel, load-balanced): aten ops one
# attention block's ring issues on top of the block's own, as (at cp=2, more per further rank), counted
# through a dispatch mode on a live 2- and 4-rank ring (gloo, torch 2.13), mean over ranks, and recounted at
# cp=2 by tests/planner/test_runtime_terms.py: rotation, slicing, the fp32 merge of partial outputs and
# log-sum-exps, fp32 gradient accumulation; and of those the ones that launch a kernel (not views, splits
# or waits).  The SDPA wrapper turns q, k, v into DTensors and back, and the SDPA forward and backward
# dispatch through DTensor: ~10 DTensor ops per block (read off ``_ContextParallel.sdpa_input_fn`` /
# ``sdpa_output_fn`` and ``_sdpa_handler``).
CP_RING_OPS = {"forward": (31.5, 23.5), "backward": (50.5, 28.5)}
CP_RING_KERNELS = {"forward": (16.0, 12.0), "backward": (21.0, 9.0)}
CP_DTENSOR_OPS = 10


def block_forward_seconds(
    block: BlockProfile,
    tokens,
    tp,
    ep,
    context: float,
    cluster: Cluster,
    precision: str,
    eff: Efficiency,
    moe_imbalance: float = 1.0,
    sp=None,
    seq_len: int | None = None,
):
    """(GEMM, attention, elementwise) forward seconds of one block for ``tokens`` local tokens; the experts
    run at the pace of the busiest EP rank (``moe_imbalance`` times the mean routed tokens; one rank holding
    every expert has no imbalance to suffer).  Without sequence parallelism every TP rank runs the norms
    and residuals on the whole activation."""
    peak = gemm_peak(cluster, precision, eff)
    gemm = sum(_block_gemm_seconds(block, g, tokens, tp, ep, cluster, peak, eff, moe_imbalance) for g in block.gemms)
    gemm = gemm * block.flops_scale
    attention = attention_seconds(block, tokens, tp, context, seq_len or 2 * context, cluster, eff)
    hbm = elementwise_bytes_per_s(cluster, eff)
    sharded = np.ones_like(tp, dtype=np.float64) if sp is None else np.where(sp > 0, 1.0, 0.0)
    norm_share = 12 * block.hidden  # norms and residuals: split over TP only with sequence parallelism
    width = (block.elementwise_width - norm_share) / tp + norm_share * (sharded / tp + (1 - sharded))
    if not eff.fused_kernels:
        width = width + block.eager_elementwise_width / tp
    # every non-GEMM kernel pays its launch gap and tail; a third of a block's kernels run in the forward
    kernels = KERNEL_SHARE * (block.host_ops_fused if eff.fused_kernels else block.host_ops) / 3
    elementwise = ACT_BYTES * tokens * width / hbm + kernels * eff.kernel_overhead_s
    return gemm, attention, elementwise


def _block_gemm_seconds(block: BlockProfile, g, tokens, tp, ep, cluster: Cluster, peak: float, eff, moe_imbalance):
    """Seconds of one of a block's GEMMs for ``tokens`` local tokens; routed experts at the busiest EP rank."""
    k, n = g.per_rank(tp)
    if not g.routed:
        return gemm_seconds(tokens, k, n, cluster, peak, eff)
    per_expert = routed_rows(block, tokens, ep, moe_imbalance) * ep / block.num_experts
    return gemm_seconds(per_expert, k, n, cluster, peak, eff, block.num_experts / ep)


def recomputed_gemm_seconds(block: BlockProfile, tokens, tp, ep, cluster: Cluster, precision: str, eff, imbalance):
    """Forward seconds of the GEMMs selective recompute runs again (MLA's up-projections)."""
    again = [g for g in block.gemms if g.recomputed]
    return _forward_gemm_seconds(block, again, tokens, tp, ep, cluster, precision, eff, imbalance)


def alternate_matmul_seconds(block: BlockProfile, tokens, tp, ep, cluster: Cluster, precision: str, eff, imbalance):
    """Forward seconds of every second matmul of the block, counted in the order the block runs them (q, k, v, o,
    gate, up, down for a dense GQA block: k, o and up).  torchtitan's op-level selective recompute keeps every
    compute op's output except these (its checkpoint policy recomputes an ``aten.mm`` whose count in the block is
    even), so its backward runs them again.  Routed experts run grouped GEMMs, which that count skips."""
    matmuls = [
        replace(g, out_features=width, parts=())
        for g in block.gemms
        if not g.routed
        for width in (g.parts or (g.out_features,))
    ]
    return _forward_gemm_seconds(block, matmuls[1::2], tokens, tp, ep, cluster, precision, eff, imbalance)


def _forward_gemm_seconds(block: BlockProfile, gemms, tokens, tp, ep, cluster: Cluster, precision: str, eff, imbalance):
    """Forward seconds of ``gemms`` (some of the block's), scaled as the block's own GEMMs are."""
    peak = gemm_peak(cluster, precision, eff)
    return block.flops_scale * sum(
        _block_gemm_seconds(block, g, tokens, tp, ep, cluster, peak, eff, imbalance) for g in gemms
    )


def _context_parallel(block: BlockProfile, tokens, tp, cp, attention, comm: Collectives, cluster: Cluster, eff):
    """Exposed ring communication (forward, backward) and the ring's own GPU work (forward, backward) of one
    block under context parallelism; ``attention`` is the block's forward attention seconds.

    The forward passes K and V round the ring, the backward passes them again and sends the K/V gradients
    back (torch accumulates them in fp32, so twice the bytes).  The exchanges run beside the attention
    kernels; the last gradient exchange has nothing left to hide behind.  torch's ring also merges each
    step's partial output in fp32 and accumulates the gradients in fp32 (HBM passes on the compute stream,
    per element of the query/output width ``q`` and the K/V width ``kv``: forward ``12 q + 42 q (cp-1)``,
    backward ``q (10 + 10 cp) + kv (10 + 22 cp)`` bytes), each of its kernels paying its launch.
    With load balancing each rank attends exactly its share of the causal square, which ``attention``
    already holds."""
    zero = np.zeros(len(cp))
    if not block.has_attention:
        return zero, zero, (zero, zero)
    kv_bytes = ACT_BYTES * tokens * block.cp_exchange_width / tp
    if eff.cp_allgather:  # gather every rank's K/V before attention, reduce-scatter their gradients: exposed
        gathered = kv_bytes * cp
        return comm.all_gather(gathered, cp, tp), comm.time("reduce_scatter", gathered, cp, tp), (zero, zero)
    torch_ring = eff.runtime == "torch"
    kv_pass = (cp - 1) * comm.send_recv(kv_bytes, cp, tp)
    grad_pass = comm.send_recv((2.0 if torch_ring else 1.0) * kv_bytes, cp, tp)
    cp_fwd = np.maximum(0.0, kv_pass - attention)
    cp_bwd = np.maximum(0.0, kv_pass + (cp - 1) * grad_pass - 2.5 * attention) + grad_pass
    if not torch_ring:
        return cp_fwd, cp_bwd, (zero, zero)
    q, kv = block.attention_flops_per_ctx / 4, block.cp_exchange_width
    hbm = elementwise_bytes_per_s(cluster, eff)
    fwd_bytes = q * (12 + 42 * (cp - 1))
    bwd_bytes = q * (10 + 10 * cp) + kv * (10 + 22 * cp)
    ring = cp > 1
    fwd_launch = ring_count(CP_RING_KERNELS["forward"], cp) * eff.kernel_overhead_s
    bwd_launch = ring_count(CP_RING_KERNELS["backward"], cp) * eff.kernel_overhead_s
    fwd_work = np.where(ring, fwd_bytes * tokens / tp / hbm + fwd_launch, 0.0)
    bwd_work = np.where(ring, bwd_bytes * tokens / tp / hbm + bwd_launch, 0.0)
    return cp_fwd, cp_bwd, (fwd_work, bwd_work)


def _ring_host_ops(block: BlockProfile, cp, eff: Efficiency, training: bool) -> tuple[np.ndarray, np.ndarray]:
    """Operators torch's ring attention issues per block on top of the block's own: (eager, DTensor)."""
    ring = (cp > 1) & block.has_attention & (eff.runtime == "torch")
    ops = ring_count(CP_RING_OPS["forward"], cp) + training * ring_count(CP_RING_OPS["backward"], cp)
    return np.where(ring, ops, 0.0), np.where(ring, CP_DTENSOR_OPS * (1 + training) / 2, 0.0)


def ring_count(count: tuple[float, float], cp) -> np.ndarray:
    """A ring count at ``cp`` ranks from its value at two and its growth per further rank."""
    return count[0] + count[1] * (np.asarray(cp, dtype=np.float64) - 2)


def host_seconds_per_op(c: Candidates, eff: Efficiency) -> np.ndarray:
    """CPU seconds to issue one operator: compiled graphs, DTensor under torch's tensor parallelism, eager."""
    if eff.compiled:
        return np.full(len(c), eff.host.compiled_s)
    dtensor = (c.tp > 1) & (eff.runtime == "torch")
    return np.where(dtensor, eff.host.dtensor_s, eff.host.eager_s)


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
    pace = slowest_gpu_pace(cluster.num_gpus, eff.gpu_spread)  # every GPU waits for the slowest one's compute
    scale = scale * pace
    tokens = (c.mbs * workload.seq_len / c.cp).astype(np.float64)
    tp, ep, cp = c.tp, c.ep, c.cp
    h = profile.hidden
    full = c.recompute == FULL
    m = micro_batches(workload, c).astype(np.float64)
    fwd = np.zeros((len(c), n_types))
    bwd = np.zeros_like(fwd)
    weight_grad = np.zeros_like(fwd)  # the weight-gradient GEMMs of backward (the forward GEMMs' FLOPs)
    exposed_comm = np.zeros_like(fwd)
    host_ops = np.zeros(n_types)
    ring_ops = np.zeros((len(c), n_types))  # torch ring attention's own operators, eager and DTensor
    ring_dtensor_ops = np.zeros_like(ring_ops)
    for j, block in enumerate(profile.blocks):
        ctx = profile.attention_context(block, workload.seq_len)
        gemm, attention, elementwise = block_forward_seconds(
            block,
            tokens,
            tp,
            ep,
            ctx,
            cluster,
            workload.precision,
            eff,
            workload.moe_imbalance,
            c.sp,
            workload.seq_len,
        )
        drop_f, drop_b = attention_dropout_seconds(block, tokens, tp, workload.seq_len, cluster, eff, attention)
        hidden_f, hidden_b = hidden_dropout_seconds(block, tokens, tp, c.sp, cluster, eff)
        bias = score_bias_seconds(block, tokens, tp, workload.seq_len, cluster, eff)
        cast_f, cast_b = fp8_cast_seconds(block, tokens, tp, ep, cluster, workload, eff)
        f = scale[j] * (gemm + attention + elementwise + drop_f + hidden_f + bias + cast_f)
        b = scale[j] * (2 * gemm + 2.5 * attention + 2 * elementwise + drop_b + hidden_b + cast_b)
        rerun = elementwise + recomputed_gemm_seconds(
            block, tokens, tp, ep, cluster, workload.precision, eff, workload.moe_imbalance
        )
        if eff.selective_alternate_matmuls:
            rerun = rerun + alternate_matmul_seconds(
                block, tokens, tp, ep, cluster, workload.precision, eff, workload.moe_imbalance
            )
        recompute = np.where(full, f, np.where(c.recompute == SELECTIVE, scale[j] * rerun, 0.0))
        activation = ACT_BYTES * tokens * h
        tp_pairs = int(block.has_attention) + int(block.has_mlp)
        # SP: all-gather before and reduce-scatter after each pair; without SP one all-reduce (the same bytes).
        tp_comm = tp_pairs * 2 * comm.all_gather(activation, tp, np.ones_like(tp))
        # --tp-comm-overlap pipelines each collective with the GEMM beside it: only what the GEMMs cannot
        # cover stays exposed, and the GEMMs lose the SMs the collective takes.
        tp_fwd = np.where(
            c.tp_overlap > 0,
            np.maximum(0.0, tp_comm - eff.overlap * scale[j] * gemm)
            + (1 - eff.overlap) * np.minimum(tp_comm, scale[j] * gemm),
            tp_comm,
        )
        ep_fwd = expert_all_to_all_seconds(
            block, tokens, tp, ep, comm, cluster.gpus_per_node, workload.moe_imbalance, eff
        )
        if workload.training:
            ep_fwd = exposed_all_to_all(ep_fwd, f + b + recompute, full, c.ep_overlap * (m > 1), eff.overlap)
        cp_fwd, cp_bwd, ring_work = _context_parallel(block, tokens, tp, cp, scale[j] * attention, comm, cluster, eff)
        f = f + ring_work[0]
        b = b + ring_work[1]
        fwd[:, j] = f
        weight_grad[:, j] = scale[j] * gemm
        exposed_comm[:, j] = tp_fwd + ep_fwd + cp_fwd
        if workload.training:
            bwd[:, j] = b + recompute + (tp_fwd + ep_fwd) * (1 + full) + cp_bwd + cp_fwd * full
        ops = block.host_ops_fused if eff.fused_kernels else block.host_ops
        host_ops[j] = ops if workload.training else ops / 3
        ring_ops[:, j], ring_dtensor_ops[:, j] = _ring_host_ops(block, cp, eff, workload.training)
    counts = layout.type_counts.T  # (T, pp)
    # fp8 recipes keep the output head in bf16 (DeepSeek-V3 sec. 3.3.1; Megatron-Core's output layer is no TE module)
    bf16_peak = cluster.gpu.peak_flops("bf16")
    head_gemm = pace * gemm_seconds(tokens, h, profile.vocab / tp, cluster, bf16_peak, eff)
    loss_fwd, loss_bwd = (pace * t for t in loss_seconds(tokens, profile.vocab, tp, cluster, eff))
    # each multi-token-prediction module projects [hidden; next embedding] (2h -> h) and passes the head again
    projection = profile.prediction_modules * pace * gemm_seconds(tokens, 2 * h, h / tp, cluster, bf16_peak, eff)
    head_fwd = profile.head_passes * (head_gemm + loss_fwd) + projection
    stage_fwd = (fwd + exposed_comm) @ counts + layout.has_head[None, :] * head_fwd[:, None]
    head_bwd = profile.head_passes * (2 * head_gemm + loss_bwd) + 2 * projection
    stage_bwd = bwd @ counts + layout.has_head[None, :] * head_bwd[:, None] if workload.training else 0 * stage_fwd

    pp = c.pp
    passes = 2 if workload.training else 1
    boundary = ACT_BYTES * tokens * h  # one micro-batch's activation (or its gradient) between stages
    p2p = passes * c.vpp * p2p_seconds(lambda b: comm.send_recv(b, pp, c.dp * c.cp * tp), boundary / tp, eff)
    # Without SP every TP rank holds the whole boundary activation: each sends its 1/tp share and the receiver
    # all-gathers them (Megatron's scatter/gather, DeepSpeed's partitioned tensors); with SP it is already split.
    gathers = TP_GATHERS[eff.runtime] if workload.training else min(1, TP_GATHERS[eff.runtime])
    gathered = gathers * c.vpp * comm.all_gather(boundary, tp, np.ones_like(tp))
    p2p = p2p + np.where((pp > 1) & (c.sp == 0), gathered, 0.0)
    dual = c.schedule == DUALPIPE
    if dual.any() and len(layout.stage_ids) != layout.pp:
        raise ValueError("DualPipe pairs stages by position: score it on an uncompressed layout")
    stage_fwd, stage_bwd = mirrored(stage_fwd, dual, mean=True), mirrored(stage_bwd, dual, mean=True)
    gpu_stage = stage_fwd + stage_bwd + p2p[:, None]
    if workload.training:
        gpu_stage = gpu_stage + mirrored(_grad_accumulation(profile, layout, c, m, cluster, eff), dual, mean=True)
    # Host: every operator of a micro-batch is issued by the CPU; the embedding, head and loss add ~40.
    stage_ops = (
        host_ops @ counts + HEAD_OPS * (profile.head_passes * layout.has_head + layout.has_embedding)[None, :] / 2
    )
    per_op = host_seconds_per_op(c, eff)[:, None]
    ring_host = per_op * (ring_ops @ counts) + eff.host.dtensor_s * (ring_dtensor_ops @ counts)
    host_stage = (per_op * stage_ops + ring_host) * (1 + full[:, None] / 3)
    if workload.training and eff.runtime == "torch":  # FSDP2 wraps each block and the root: its hooks' own ops
        groups = counts.sum(axis=0) + 1
        host_stage = host_stage + eff.host.eager_s * fsdp2_host_ops(c.zero, m, c.pp > 1)[:, None] * groups[None, :]
    host_stage = mirrored(host_stage, dual, mean=True)
    # Asynchronous launch hides the host behind the GPU (the slower sets the pace), pipelined torch runs included:
    # torch.distributed.pipelining's P2P waits (``_wait_batch_p2p``: ``Work.wait()``) make the compute stream wait
    # for NCCL, not the host.  Under CUDA_LAUNCH_BLOCKING=1 each launch returns when its kernel has finished, so the
    # host and the GPU take turns.
    serial = np.full((len(c), 1), eff.launch_blocking)
    stage = np.where(serial, gpu_stage + host_stage, np.maximum(gpu_stage, host_stage))
    slowest = row_max(stage)
    bubble = (stage @ layout.multiplicity - slowest) / c.vpp
    bubble = np.where(c.schedule == ZERO_BUBBLE, bubble * eff.zero_bubble_fraction, bubble)
    if workload.training and dual.any():  # DualPipe: (pp/2 - 1)(F&B + B - 3W), F&B a forward and a backward chunk
        head_w = profile.head_passes * head_gemm + projection
        stage_w = mirrored(weight_grad @ counts + layout.has_head[None, :] * head_w[:, None], dual, mean=True)
        chunk = row_max(stage_fwd + 2 * stage_bwd - 3 * stage_w + p2p[:, None])
        bubble = np.where(dual, (pp / 2 - 1) * chunk, bubble)
    pipeline = m * slowest + bubble

    out = {
        "pipeline": pipeline,
        "bubble": bubble,
        "compute_per_microbatch": row_max(fwd @ counts) + (row_max(bwd @ counts) if workload.training else 0),
        "exposed_comm_per_microbatch": row_max(exposed_comm @ counts) + p2p,
        "gpu_per_microbatch": row_max(gpu_stage),
        "host_per_microbatch": row_max(host_stage),
        "host_bound": (row_max(host_stage - gpu_stage) > 0).astype(np.float64),
    }
    if workload.training:
        dp_exposed, optimizer = data_parallel_seconds(
            profile, cluster, workload, c, layout, comm, eff, stage_fwd, stage_bwd, m
        )
        out["data_parallel_exposed"] = dp_exposed
        out["optimizer"] = optimizer
        out["step"] = pipeline + dp_exposed + optimizer
    else:
        out["step"] = pipeline
    out["hardware_flops_per_token"] = _hardware_flops_per_token(profile, workload, c)
    return out


def _grad_accumulation(profile, layout: StageLayout, c: Candidates, m, cluster: Cluster, eff: Efficiency):
    """HBM seconds per micro-batch that each stage spends adding its weight gradients into the buffer
    they accumulate in over the step, (C, stages): per local parameter, ``runtimes.grad_accum_bytes`` (Megatron's
    fp32 main-grad hook, autograd's 16-bit accumulation, DeepSpeed's cast-and-add into fp32, FSDP2's fp32 upcast and
    adds)."""
    dense, experts = stage_params(profile, layout)
    pipelined = c.pp > 1
    on_dense = grad_accum_bytes(eff, m, c.zero, c.shard, pipelined)[:, None] * dense[None, :] / c.tp[:, None]
    expert_shard = np.maximum(c.shard // c.ep, 1)  # routed experts shard over what EP leaves of the shard group
    on_experts = grad_accum_bytes(eff, m, c.zero, expert_shard, pipelined)[:, None] * experts[None, :]
    return (on_dense + on_experts / (c.tp * c.ep)[:, None]) / (elementwise_bytes_per_s(cluster, eff))


def _hardware_flops_per_token(profile: ModelProfile, workload: Workload, c: Candidates) -> np.ndarray:
    """Model FLOPs plus what recompute adds (full: every block's forward once more)."""
    model = profile.model_flops_per_token(workload.seq_len, workload.training)
    if not workload.training:
        return np.full(len(c), model)
    block_forward = (model / 3) - profile.head_flops_per_token
    return model + np.where(c.recompute == FULL, block_forward, 0.0)
