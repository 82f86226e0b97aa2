"""Inference plans: TP/PP/EP and the KV-cache budget for a target context length and concurrency.

Serving memory per GPU is the weights of the fullest pipeline stage (sharded by TP; routed experts
by EP or TP), a working reserve for the largest prefill chunk, and the KV cache, which takes what
``--gpu-memory-utilization`` leaves.  The cache a sequence needs at the target context counts each
layer as it is: GQA heads split over TP (replicated when TP exceeds them), MLA's latent replicated
on every TP rank, sliding-window layers capped at their window.

Decode is bound by memory bandwidth: each step reads the stage's weights (for MoE only the experts
the batch routes to) and every sequence's KV cache, so the time per output token is those bytes
over HBM bandwidth, or the matmul time when the batch is large enough to be compute-bound, plus two
TP all-reduces per layer and the pipeline hand-offs.  The result states the matching vLLM settings.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adapt.core.errors import BadInput
from adapt.core.spec import ModelSpec
from parallel_planner.catalog import GIB
from parallel_planner.cluster import Cluster
from parallel_planner.comms import Collectives
from parallel_planner.efficiency import Efficiency
from parallel_planner.kernel_rates import attention_fraction
from parallel_planner.profile import profile_model

WEIGHT_BYTES = {"bf16": 2, "fp8": 1}
BATCHED_TOKENS = 8192  # the prefill chunk the activation reserve is sized for (stated as --max-num-batched-tokens)
RESERVED_GIB = 1.5  # CUDA context, NCCL buffers, captured CUDA graphs
KERNELS_PER_LAYER = 10  # launches per layer per decode step (CUDA graphs shrink their gaps, not their tails)


@dataclass(frozen=True)
class ServingWorkload:
    context_len: int  # longest sequence served: prompt plus output (--max-model-len)
    concurrency: int  # sequences decoding at once, over all replicas
    precision: str = "bf16"  # weights
    kv_bytes: int = 2  # per cached element (bf16; 1 for an fp8 KV cache)
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.context_len < 1 or self.concurrency < 1:
            raise BadInput(
                f"context length and concurrency must be positive (got {self.context_len}, {self.concurrency})"
            )
        if self.precision not in WEIGHT_BYTES:
            raise BadInput(f"--precision must be one of {', '.join(WEIGHT_BYTES)}, got {self.precision!r}")
        if not 0.1 <= self.gpu_memory_utilization <= 1.0:
            raise BadInput(f"--gpu-memory-utilization must be between 0.1 and 1, got {self.gpu_memory_utilization}")
        if self.kv_bytes not in (1, 2, 4):
            raise BadInput(f"KV-cache element size must be 1, 2 or 4 bytes, got {self.kv_bytes}")


@dataclass
class ServingPlan:
    tp: int
    pp: int
    ep: int
    replicas: int  # independent copies of the model (vLLM data parallelism)
    fits: bool
    memory_gib_per_gpu: float  # weights + reserve + the KV cache the target concurrency uses, fullest stage
    memory_breakdown: dict[str, float]  # GiB per GPU on the fullest stage
    kv_gib_per_sequence: float  # per GPU, fullest stage, at the target context
    max_concurrent_sequences: int  # at the target context, all replicas
    sequences_per_replica: int  # of the target concurrency
    time_per_output_token_s: float  # one decode step at the target context and concurrency
    time_breakdown: dict[str, float]
    output_tokens_per_s: float  # all replicas
    vllm: dict[str, Any]  # the launch settings for this layout
    rank: int = 0
    why_not: str = ""


@dataclass
class InferencePlanResult:
    source: str
    cluster: dict[str, Any]
    workload: dict[str, Any]
    plans: list[ServingPlan]
    searched: int
    feasible: int
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> ServingPlan:
        return self.plans[0]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["mode"] = "inference"
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InferencePlanResult:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["plans"] = [ServingPlan(**p) for p in data.get("plans", [])]
        return cls(**values)


@dataclass(frozen=True)
class _Layer:
    params: int  # all parameters of the layer
    expert_params: int  # of which routed experts
    num_experts: int
    top_k: int
    active_params: int  # read per token: dense plus top_k experts
    kv_width: int  # cached elements per token
    kv_heads: int  # 0: the cache is replicated on every TP rank (MLA latent)
    window: int | None
    attention_flops_per_ctx: int
    hidden: int
    head_dim: int = 0  # the attention kernel's rate depends on it (kernel_rates.attention_fraction)


def _layers(spec: ModelSpec) -> list[_Layer]:
    profile = profile_model(spec)
    layers = []
    for block, kind in zip(spec.blocks, profile.layer_types):
        bp = profile.blocks[int(kind)]
        attn = block.attention
        mla = attn is not None and attn.kind == "mla"
        per_expert = bp.expert_params // bp.num_experts if bp.num_experts else 0
        layers.append(_Layer(
            params=block.params, expert_params=bp.expert_params, num_experts=bp.num_experts, top_k=bp.top_k,
            active_params=block.params - bp.expert_params + bp.top_k * per_expert, kv_width=bp.kv_cache_width,
            kv_heads=0 if mla else bp.num_kv_heads, window=bp.window, attention_flops_per_ctx=bp.attention_flops_per_ctx,
            hidden=spec.hidden_size, head_dim=bp.head_dim,
        ))  # fmt: skip
    return layers


def _stages(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges, the first stages one layer longer when they do not divide evenly."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def _kv_share(layer: _Layer, tp: int) -> float:
    """Fraction of a layer's cache one TP rank holds: its KV heads (at least one), or all of an MLA latent."""
    if layer.kv_heads == 0:
        return 1.0
    return math.ceil(layer.kv_heads / tp) / layer.kv_heads


def _candidates(spec: ModelSpec, cluster: Cluster) -> list[tuple[int, int, int]]:
    heads = {b.attention.num_heads for b in spec.blocks if b.attention is not None and b.attention.num_heads}
    moe = any(b.mlp.kind == "moe" for b in spec.blocks)
    out = []
    tp = 1
    while tp <= min(cluster.gpus_per_node, cluster.num_gpus):
        if all(h % tp == 0 for h in heads) and cluster.num_gpus % tp == 0:
            for pp in range(1, min(spec.num_layers, cluster.num_gpus // tp) + 1):
                if (cluster.num_gpus // tp) % pp == 0:
                    out += [(tp, pp, ep) for ep in ({1, tp} if moe else {1})]
        tp *= 2
    return out


def plan_inference(spec: ModelSpec, cluster: Cluster, workload: ServingWorkload, top_k: int = 5,
                   efficiency: Efficiency | None = None) -> InferencePlanResult:  # fmt: skip
    """Score every TP x PP (x EP for MoE) layout for serving; fitting layouts first, fastest per token first."""
    eff = efficiency or Efficiency()
    layers = _layers(spec)
    plans = [_score(spec, layers, cluster, workload, eff, *c) for c in _candidates(spec, cluster)]
    if not plans:
        raise BadInput(f"no tensor-parallel size divides the model's attention heads on {cluster.num_gpus} GPUs")
    plans.sort(key=lambda p: (not p.fits, p.time_per_output_token_s if p.fits else p.memory_gib_per_gpu, p.tp * p.pp))
    for rank, plan in enumerate(plans, 1):
        plan.rank = rank
    notes = [
        (
            f"time per output token is one decode step with every sequence at the full {workload.context_len}-token context "
            "(an upper bound: shorter sequences read less cache)"
        ),
        (
            "pipeline stages run one after another for a batch: vLLM overlaps batches across stages, which raises "
            "throughput but not the time per token"
        ),
    ]
    if not any(layer.kv_width for layer in layers):
        notes.append("no attention KV cache found in the spec: recurrent state, if any, is not counted")
    if not plans[0].fits:
        notes.append(f"no layout fits: {plans[0].why_not}")
    return InferencePlanResult(
        source=spec.source, cluster=cluster.to_dict(), workload=dataclasses.asdict(workload), plans=plans[:top_k],
        searched=len(plans), feasible=sum(p.fits for p in plans), notes=notes,
    )  # fmt: skip


def _score(
    spec, layers: list[_Layer], cluster: Cluster, work: ServingWorkload, eff: Efficiency, tp: int, pp: int, ep: int
) -> ServingPlan:
    gpu = cluster.gpu
    wbytes, replicas = WEIGHT_BYTES[work.precision], cluster.num_gpus // (tp * pp)
    per_replica = math.ceil(work.concurrency / replicas)
    profile = profile_model(spec)
    stages = _stages(len(layers), pp)
    embed, head = profile.embed_params, profile.head_params
    collectives = Collectives(cluster, eff.link_model())
    one = np.ones(1, dtype=np.int64)
    memory, times = [], []
    for index, stage in enumerate(stages):
        members = [layers[i] for i in stage]
        params = sum(m.params for m in members) + (embed if index == 0 else 0) + (head if index == pp - 1 else 0)
        if profile.tied and pp == 1:  # one matrix serves as embedding and head
            params -= min(embed, head)
        weights = params * wbytes / tp  # routed experts: split over EP ranks or TP shards, the same bytes
        kv_seq = sum(m.kv_width * _kv_share(m, tp) * work.kv_bytes * min(work.context_len, m.window or work.context_len)
                     for m in members)  # fmt: skip
        activation = _activation_bytes(spec, tp, per_replica)
        memory.append((weights, activation, kv_seq))
        # One decode step of this stage for the replica's batch (the embedding lookup reads only its rows).
        read = (sum(_weights_read(m, per_replica) for m in members) + (head if index == pp - 1 else 0)) * wbytes / tp
        kv_read = per_replica * kv_seq
        mem_s = (read + kv_read) / (gpu.hbm_gbps * 1e9 * eff.memory_bw)
        peak = gpu.peak_flops(work.precision)
        flops = per_replica * 2 * (sum(m.active_params for m in members) + (head if index == pp - 1 else 0)) / tp
        # attention FLOPs over each layer's kernel rate (the training model's rates, by head dim)
        attention_s = (
            per_replica
            * sum(
                m.attention_flops_per_ctx
                * min(work.context_len, m.window or work.context_len)
                / attention_fraction(eff.attention, gpu.name, m.head_dim)
                for m in members
            )
            / (tp * peak)
        )
        compute_s = flops / (peak * gpu.gemm_ceiling * eff.gemm_scale) + attention_s
        allreduce = collectives.time("all_reduce", np.array([per_replica * spec.hidden_size * 2.0]), tp * one, one)[0]
        comm_s = 2 * len(members) * allreduce
        launch_s = len(members) * KERNELS_PER_LAYER * eff.kernel_overhead_s
        times.append({"memory_s": mem_s, "compute_s": compute_s, "tp_comm_s": comm_s, "launch_s": launch_s})
    usable = gpu.memory_bytes * work.gpu_memory_utilization - RESERVED_GIB * GIB
    budgets = [usable - w - a for w, a, _ in memory]
    fullest = max(range(pp), key=lambda s: memory[s][0] + memory[s][1] + per_replica * memory[s][2])
    weights, activation, kv_seq = memory[fullest]
    if any(b <= 0 for b in budgets):
        per_replica_max = 0
    else:
        per_replica_max = min(int(b // kv) if kv else 10**9 for b, (_, _, kv) in zip(budgets, memory))
    max_sequences = per_replica_max * replicas
    fits = max_sequences >= work.concurrency
    handoff = (
        collectives.time("send_recv", np.array([per_replica * spec.hidden_size * 2.0]), 2 * one, tp * one)[0]
        if pp > 1
        else 0.0
    )
    breakdown = {k: sum(t[k] for t in times) for k in ("memory_s", "compute_s", "tp_comm_s", "launch_s")}
    breakdown["pp_handoff_s"] = (pp - 1) * handoff
    tpot = (
        sum(max(t["memory_s"], t["compute_s"]) + t["tp_comm_s"] + t["launch_s"] for t in times)
        + breakdown["pp_handoff_s"]
    )
    why_not = ""
    if not fits:
        why_not = (f"tp={tp} pp={pp}: weights {weights / GIB:.1f} GiB + reserve {(activation / GIB + RESERVED_GIB):.1f} GiB leave "
                   f"room for {per_replica_max} sequences of {work.context_len} tokens per replica, {per_replica} needed")  # fmt: skip
    return ServingPlan(
        tp=tp, pp=pp, ep=ep, replicas=replicas, fits=fits,
        memory_gib_per_gpu=(weights + activation + per_replica * kv_seq) / GIB + RESERVED_GIB,
        memory_breakdown={"weights": weights / GIB, "activations": activation / GIB, "reserved": RESERVED_GIB,
                          "kv_cache": per_replica * kv_seq / GIB, "kv_budget": max(budgets[fullest], 0) / GIB},
        kv_gib_per_sequence=kv_seq / GIB, max_concurrent_sequences=max_sequences, sequences_per_replica=per_replica,
        time_per_output_token_s=tpot, time_breakdown=breakdown,
        output_tokens_per_s=replicas * per_replica / tpot if tpot > 0 else 0.0,
        vllm=vllm_settings(tp, pp, ep, replicas, work, per_replica), why_not=why_not,
    )  # fmt: skip


def _weights_read(layer: _Layer, batch: int) -> float:
    """Parameters one decode step reads: all dense ones, and the experts the batch's tokens route to (expected)."""
    if not layer.num_experts:
        return float(layer.params)
    touched = layer.num_experts * (1 - (1 - layer.top_k / layer.num_experts) ** batch)
    return layer.params - layer.expert_params + layer.expert_params * touched / layer.num_experts


def _activation_bytes(spec: ModelSpec, tp: int, sequences: int) -> float:
    """Peak working memory of the largest prefill chunk: a few hidden-wide tensors, the widest MLP slice, logits."""
    widest = max(
        (b.mlp.intermediate_size * max(1, b.mlp.top_k) + b.mlp.shared_intermediate_size for b in spec.blocks), default=0
    )
    per_token = 4 * spec.hidden_size + 3 * widest / tp
    logits = min(sequences, BATCHED_TOKENS) * spec.vocab_size / tp * 4  # fp32 logits of the last position per sequence
    return BATCHED_TOKENS * per_token * 2 + logits


def vllm_settings(tp: int, pp: int, ep: int, replicas: int, work: ServingWorkload, sequences: int) -> dict[str, Any]:
    """vLLM's engine arguments for this layout (settings, not a run)."""
    settings: dict[str, Any] = {
        "--tensor-parallel-size": tp,
        "--pipeline-parallel-size": pp,
        "--max-model-len": work.context_len,
        "--gpu-memory-utilization": work.gpu_memory_utilization,
        "--max-num-seqs": sequences,
        "--max-num-batched-tokens": BATCHED_TOKENS,
    }
    if replicas > 1:
        settings["--data-parallel-size"] = replicas
    if ep > 1:
        settings["--enable-expert-parallel"] = True
    if work.kv_bytes == 1:
        settings["--kv-cache-dtype"] = "fp8"
    if work.precision == "fp8":
        settings["--quantization"] = "fp8"
    return settings


def settings_line(settings: dict[str, Any]) -> str:
    return " ".join(flag if value is True else f"{flag} {value}" for flag, value in settings.items())
