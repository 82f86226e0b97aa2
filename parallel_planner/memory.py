"""Memory per GPU of every candidate on every pipeline stage, as a breakdown.

Model states follow ZeRO (Rajbhandari et al.) as ``ParallelPlan`` realises it with FSDP2 mixed
precision: fp32 master weights, fp32 reduced gradients and optimizer states live on the shard (over
the data x context parallel ranks from the ZeRO stage that shards them; under HSDP over one shard
group, ``dp_shard x cp``, replicated across the groups); the bf16 compute copy of the
weights stays unsharded below ZeRO-3, and below ZeRO-2 the bf16 gradients accumulate unsharded until
the last micro-batch reduces them.  Routed experts shard over EP x TP and
replicate over the expert-data-parallel ranks.  Activations follow Korthikanti et al. (2022) with
sequence parallelism, generalised by reading the saved tensors' widths off the block structure (GQA,
gated MLPs, MoE routing, MLA latents; flash attention keeps no s^2 term), times the micro-batches a
stage holds in flight under its pipeline schedule.  The widths assume fused norm and GLU kernels
(adapt's operators, Transformer Engine); ``fused_kernels=False`` adds what transformers' eager modules
keep as well; that eager figure is checked against the bytes autograd saves for real transformers
decoder layers, dense and MoE (``tests/planner/test_fidelity.py``).  The busiest expert-parallel rank holds ``moe_imbalance`` times
the mean routed activations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from parallel_planner.catalog import GIB
from parallel_planner.cluster import Cluster
from parallel_planner.layout import RECOMPUTE, SCHEDULES, Candidates, StageLayout, mirrored, row_max
from parallel_planner.profile import ModelProfile
from parallel_planner.workload import Workload

ACT_BYTES = 2  # bf16 activations
# An fp8 element with its share of a 4-byte scale per 1x128 tile (DeepSeek-V3 sec. 3.3.2's fine-grained quantisation)
FP8_BYTES = 1 + 4 / 128
FULL = RECOMPUTE.index("full")
SELECTIVE = RECOMPUTE.index("selective")
INTERLEAVED = (SCHEDULES.index("interleaved_1f1b"), SCHEDULES.index("zero_bubble"))
DUALPIPE = SCHEDULES.index("dualpipe")


@dataclass(frozen=True)
class MemoryModel:
    fragmentation: float = 0.05  # allocator headroom kept free
    reserved_gib: float = 1.0  # CUDA context, cuBLAS and NCCL workspaces
    weight_bytes: int = 2  # bf16 compute copy (and unsharded bf16 gradients)
    grad_bytes: int = 4  # fp32 reduced gradient shard
    master_bytes: int = 4  # fp32 master weights
    bucket_bytes: float = 100e6  # gradient-reduction bucket (DDP / FSDP)
    fused_kernels: bool = True  # norms and GLUs as fused kernels (adapt's operators, TE); False: eager modules
    # The routing weight scales the experts' activation before their down-projection (a fused SwiGLU-with-weight),
    # so no expert output is kept for the weight's gradient.
    moe_weighted_activation: bool = False
    hidden_dropout: bool = False  # each residual branch keeps its 1-byte dropout mask for backward

    @classmethod
    def of(cls, eff) -> MemoryModel:
        """The memory model of the software a ``efficiency.Efficiency`` describes."""
        return cls(
            fused_kernels=eff.fused_kernels,
            moe_weighted_activation=eff.moe_weighted_activation,
            hidden_dropout=eff.hidden_dropout,
        )

    def usable_bytes(self, cluster: Cluster) -> float:
        return cluster.gpu.memory_bytes * (1 - self.fragmentation)


def micro_batches(workload: Workload, c: Candidates) -> np.ndarray:
    return workload.global_batch // (c.mbs * c.dp)


def in_flight(c: Candidates, m: np.ndarray, pp: int, stage_ids: np.ndarray) -> np.ndarray:
    """Micro-batches of activations each physical stage holds at its peak, (C, pp).

    1F1B warms up ``pp - i`` micro-batches on stage i; the interleaved schedules (1F1B and zero-bubble)
    warm up ``2(pp-i-1) + (v-1)pp + 1`` chunks of 1/v of the stage.
    """
    stage = stage_ids[None, :]
    v = c.vpp[:, None]
    plain = np.minimum(m[:, None], pp - stage)
    chunks = np.minimum(m[:, None] * v, 2 * (pp - stage - 1) + (v - 1) * pp + 1)
    return np.where(np.isin(c.schedule, INTERLEAVED)[:, None] & (v > 1), chunks / v, plain).astype(np.float64)


def stage_params(profile: ModelProfile, layout: StageLayout) -> tuple[np.ndarray, np.ndarray]:
    """(dense, routed-expert) parameters held by each physical stage before any sharding."""
    dense = layout.type_counts @ np.array([b.dense_params for b in profile.blocks], dtype=np.float64)
    experts = layout.type_counts @ np.array([b.expert_params for b in profile.blocks], dtype=np.float64)
    dense = dense + layout.has_embedding * profile.embed_params
    shared_with_embedding = profile.vocab * profile.hidden if profile.tied and layout.pp == 1 else 0
    return dense + layout.has_head * (profile.head_params - shared_with_embedding), experts


def model_state_floor(profile: ModelProfile, workload: Workload, c: Candidates, mm: MemoryModel) -> np.ndarray:
    """A lower bound of model-state bytes on the fullest stage (the mean stage), to prune before scoring."""
    if not workload.training:
        return np.zeros(len(c))
    dense = sum(b.count * b.dense_params for b in profile.blocks) + profile.embed_params + profile.head_params
    experts = sum(b.count * b.expert_params for b in profile.blocks)
    dense_gpu = dense / (c.pp * c.tp)
    expert_gpu = experts / (c.pp * c.tp * c.ep)
    shard = c.shard.astype(np.float64)
    on_host = c.offload > 0
    sharded_bytes = np.where(on_host, 0.0, mm.master_bytes + mm.grad_bytes + workload.optimizer_state_bytes)
    per_dense = np.select(
        [c.zero == 0, c.zero == 1, c.zero == 2],
        [
            2 * mm.weight_bytes + sharded_bytes,
            2 * mm.weight_bytes + sharded_bytes / shard,
            mm.weight_bytes + sharded_bytes / shard,
        ],
        sharded_bytes / shard,
    )
    per_expert = np.select(
        [c.zero == 0, c.zero == 1, c.zero == 2],
        [
            2 * mm.weight_bytes + sharded_bytes,
            2 * mm.weight_bytes + sharded_bytes * c.ep / shard,
            mm.weight_bytes + sharded_bytes * c.ep / shard,
        ],
        sharded_bytes * c.ep / shard,
    )
    return dense_gpu * per_dense + expert_gpu * per_expert


def activation_bytes_per_block(
    profile: ModelProfile,
    workload: Workload,
    c: Candidates,
    fused_kernels: bool = True,
    weighted: bool = False,
    hidden_dropout: bool = False,
) -> np.ndarray:
    """Saved activations of one block of each type for one micro-batch, (C, T).

    Selective recompute drops the recomputable widths (norm and activation outputs, MLA's up-projections, the
    experts' activation output); with fp8-cached activations (``workload.act_cache_bits == 8``) what only the
    fp8 GEMMs read is kept as fp8 with its tile scales (``FP8_BYTES``); ``weighted``: the experts' output is not
    kept (``MemoryModel.moe_weighted_activation``)."""
    tokens = (c.mbs * workload.seq_len / c.cp)[:, None].astype(np.float64)
    tp = c.tp[:, None].astype(np.float64)
    unfused = not fused_kernels
    cached = FP8_BYTES if workload.act_cache_bits == 8 else ACT_BYTES

    def widths(name: str) -> np.ndarray:
        return np.array([getattr(b, name) for b in profile.blocks], dtype=np.float64)[None, :]

    kept = ACT_BYTES * (widths("saved_width") - widths("recomputable_width") + unfused * widths("unfused_width"))
    # hidden dropout's masks, one byte per element of each residual branch (Korthikanti et al.'s 2sbh of masks)
    masks = hidden_dropout * widths("residual_branches") * profile.hidden
    kept = kept + masks
    recomputable = ACT_BYTES * (widths("recomputable_width") - widths("cacheable_width")) + cached * widths(
        "cacheable_width"
    )
    routed_recomputable = cached * widths("routed_recomputable_width")
    routed_kept = (
        ACT_BYTES
        * (widths("routed_width") - widths("routed_cacheable_width") + unfused * widths("unfused_routed_width"))
        + cached * widths("routed_cacheable_width")
        - routed_recomputable
        - weighted * ACT_BYTES * widths("routed_output_width")
    )
    top_k = widths("top_k")
    busiest = np.where(c.ep > 1, workload.moe_imbalance, 1.0)[:, None]  # the busiest EP rank's routed share
    selective = c.recompute[:, None] == SELECTIVE
    per_token = (
        kept
        + busiest * top_k * routed_kept
        + np.where(selective, 0.0, recomputable + busiest * top_k * routed_recomputable)
    )
    per_token = np.where(c.recompute[:, None] == FULL, ACT_BYTES * profile.hidden, per_token)  # block input only
    # Without sequence parallelism each TP rank keeps the whole norm inputs and the GEMM inputs the norms
    # feed (Korthikanti et al.'s 10sbh term: 4h elements and the dropout masks), or the whole block input.
    full = c.recompute[:, None] == FULL
    replicated = (
        np.where(full, ACT_BYTES * profile.hidden, ACT_BYTES * 4 * profile.hidden + masks)
        * (c.sp[:, None] == 0)
        * (tp > 1)
    )
    return tokens * (per_token + replicated * (tp - 1)) / tp


def memory_breakdown(
    profile: ModelProfile, cluster: Cluster, workload: Workload, c: Candidates, layout: StageLayout, mm: MemoryModel
) -> dict[str, np.ndarray]:
    """Bytes per GPU by component for every candidate (rows) and physical stage (columns)."""
    pp = layout.type_counts.shape[0]  # columns: physical stages, or their distinct representatives
    tp = c.tp[:, None].astype(np.float64)
    shard = c.shard[:, None].astype(np.float64)
    expert_shard = shard / c.ep[:, None]
    zero = c.zero[:, None]
    dense, experts = stage_params(profile, layout)
    dual = c.schedule == DUALPIPE  # a DualPipe device holds two stages: twice the parameters (its Table 2)
    dense_gpu = mirrored(dense, dual, mean=False) / tp
    expert_gpu = mirrored(experts, dual, mean=False) / (tp * c.ep[:, None])
    tokens = (c.mbs * workload.seq_len / c.cp)[:, None].astype(np.float64)
    weighted = mm.moe_weighted_activation
    per_block = activation_bytes_per_block(profile, workload, c, mm.fused_kernels, weighted, mm.hidden_dropout)
    full_width = activation_bytes_per_block(
        profile, workload, _no_recompute(c), mm.fused_kernels, weighted, mm.hidden_dropout
    )
    largest_block = max(b.dense_params + b.expert_params for b in profile.blocks)
    out: dict[str, np.ndarray] = {}

    def sharded(bytes_per_param: float, from_stage: int) -> np.ndarray:
        d = np.where(zero >= from_stage, shard, 1.0)
        e = np.where(zero >= from_stage, expert_shard, 1.0)
        return bytes_per_param * (dense_gpu / d + expert_gpu / e)

    m = micro_batches(workload, c)
    if workload.training:
        compute_copy = mm.weight_bytes * (dense_gpu + expert_gpu)
        out["parameters"] = np.where(zero == 3, 0.0, compute_copy) + np.where(
            c.offload[:, None] > 0, 0.0, sharded(mm.master_bytes, 1)
        )
        unsharded_grads = np.where(zero <= 1, mm.weight_bytes * (dense_gpu + expert_gpu), 0.0)
        out["gradients"] = unsharded_grads + np.where(c.offload[:, None] > 0, 0.0, sharded(mm.grad_bytes, 1))
        out["optimizer_states"] = np.where(c.offload[:, None] > 0, 0.0, sharded(workload.optimizer_state_bytes, 1))
        stage_act = per_block @ layout.type_counts.T
        working = np.where(c.recompute[:, None] == FULL, row_max(full_width)[:, None], 0.0)
        held = stage_act * in_flight(c, m, layout.pp, layout.stage_ids)
        if dual.any():  # device i holds up to pp - i micro-batches of its own stage and i + 1 of the mirrored one
            half = (m / 2)[:, None]  # (pp + 1 in all, DualPipe's Table 2), each direction running half of them
            stage = layout.stage_ids[None, :]
            paired = stage_act * np.minimum(half, layout.pp - stage) + stage_act[:, ::-1] * np.minimum(half, stage + 1)
            held = np.where(dual[:, None], paired, held)
        out["activations"] = held + working
    else:
        out["parameters"] = mm.weight_bytes * (dense_gpu + expert_gpu)
        out["activations"] = np.broadcast_to(row_max(full_width)[:, None], (len(c), pp)).copy()
        per_gpu_width = np.stack([_kv_cache_width_per_gpu(b, c.tp) for b in profile.blocks], axis=1)
        sequences = (workload.global_batch / c.dp)[:, None]
        out["kv_cache"] = (ACT_BYTES * sequences * workload.seq_len / c.cp[:, None]) * (
            per_gpu_width @ layout.type_counts.T
        )
    logits = profile.head_passes * tokens * profile.vocab / tp * (2 + 4)  # bf16 logits, fp32 softmax, per head pass
    out["activations"] = out["activations"] + mirrored(layout.has_head, dual, mean=False) * logits

    buffers = np.where(c.tp[:, None] > 1, 2 * ACT_BYTES * tokens * profile.hidden, 0.0)
    buffers = buffers + np.where(c.pp[:, None] > 1, 4 * ACT_BYTES * tokens * profile.hidden / tp, 0.0)
    top_k = max((b.top_k for b in profile.blocks), default=0)
    dispatch = 4 * ACT_BYTES * tokens * top_k * workload.moe_imbalance * profile.hidden / tp
    buffers = buffers + np.where(c.ep[:, None] > 1, dispatch, 0.0)
    if workload.training:
        buffers = buffers + np.where(zero <= 1, 2 * mm.bucket_bytes, mm.weight_bytes * largest_block / tp)
        buffers = buffers + np.where(zero == 3, 2 * mm.weight_bytes * largest_block / tp, 0.0)
    out["comm_buffers"] = np.broadcast_to(buffers, (len(c), pp)).copy()
    out["reserved"] = np.full((len(c), pp), mm.reserved_gib * GIB)
    out["total"] = sum(out.values())
    return out


def _kv_cache_width_per_gpu(block, tp: np.ndarray) -> np.ndarray:
    """Cached elements per token on one GPU: per-head K/V split over TP (replicated below one head per
    rank); a latent cache (MLA) is not split by heads and stays whole."""
    per_head_cache = block.kv_cache_width == block.cp_exchange_width and block.num_kv_heads > 0
    if not per_head_cache:
        return np.full(len(tp), float(block.kv_cache_width))
    return block.kv_cache_width / block.num_kv_heads * np.ceil(block.num_kv_heads / tp)


def _no_recompute(c: Candidates) -> Candidates:
    return dataclasses.replace(c, recompute=np.zeros_like(c.recompute))
