"""The layouts the search scores: every structurally valid TP x CP x PP x DP layout (EP inside DP x CP, HSDP shard
groups of whole nodes) crossed with its knobs and grouped by pipeline split; ``search`` scores and ranks them."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from parallel_planner.cluster import Cluster
from parallel_planner.layout import SCHEDULES, SPLITS, Candidates
from parallel_planner.profile import ModelProfile
from parallel_planner.workload import Workload

HSDP_GROUP_NODES = (1, 2, 4, 8)  # HSDP shard groups the open search tries, in whole nodes
MICRO_BATCHES = (1, 2, 4, 8, 16)
VIRTUAL_STAGES = (1, 2, 3, 4, 6, 8)


@dataclass(frozen=True)
class SearchSpace:
    """Limits of the enumeration; ``cross_node`` lets TP and EP leave the node when ranking."""

    cross_node: bool = False
    offload: bool = False  # optimizer offload only joins when nothing fits on the GPUs alone
    max_cp: int = 64
    min_cp_chunk: int = 256  # tokens per context-parallel rank below which ring attention cannot pay off
    tp_overlap: bool = False  # the runtime can pipeline TP collectives with GEMMs (adapt's eager TP cannot)
    ep_overlap: bool = False  # the runtime can run the EP all-to-all beside another micro-batch's compute
    # the runtime can shard these experts: adapt's (``adapt.runtime.expert_parallel``) shards [experts, ...] tensors
    ep_shardable: bool = True


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def enumerate_candidates(
    profile: ModelProfile, cluster: Cluster, workload: Workload, fixed: dict[str, int], space: SearchSpace
) -> tuple[dict[tuple[int, int, int], Candidates], Counter]:
    """Structurally valid layouts grouped by (pp, vpp, split), and how many families were rejected why."""
    n, per_node = cluster.num_gpus, cluster.gpus_per_node
    rejected: Counter = Counter()
    heads = [b.num_heads for b in profile.blocks if b.has_attention]
    kv_heads = [b.num_kv_heads for b in profile.blocks if b.has_attention]
    experts = [b.num_experts for b in profile.blocks if b.is_moe]
    outer: dict[tuple[int, int], list[tuple[int, ...]]] = {}

    def choices(key: str, values) -> list[int]:
        return [v for v in values if key not in fixed or fixed[key] == v]

    for tp in choices("tp", _divisors(n)):
        if any(h % tp for h in heads) or any(g % tp for g in kv_heads):
            rejected["tensor parallel must divide the attention and kv heads"] += 1
            continue
        if tp > per_node and not space.cross_node and "tp" not in fixed:
            rejected["tensor parallel kept inside a node"] += 1
            continue
        for cp in choices("cp", _divisors(n // tp)):
            if cp > 1 and (
                workload.seq_len % (2 * cp) or cp > space.max_cp or workload.seq_len // cp < space.min_cp_chunk
            ):
                rejected[f"context parallel needs 2*cp equal chunks of at least {space.min_cp_chunk // 2} tokens"] += 1
                continue
            for pp in choices("pp", _divisors(n // (tp * cp))):
                if pp > profile.num_layers:
                    rejected["pipeline stages must each hold at least one layer"] += 1
                    continue
                dp = n // (tp * cp * pp)
                if "dp" in fixed and fixed["dp"] != dp:
                    continue
                if workload.global_batch % dp:
                    rejected["global batch must divide over the data-parallel ranks"] += 1
                    continue
                for row in _outer_rows(tp, cp, pp, dp, per_node, profile, workload, experts, fixed, rejected, space):
                    outer.setdefault((row[1], row[6]), []).append(row)
    return {key: cands for key, cands in _expand(outer, workload, fixed, space)}, rejected


def _replicas(tp: int, dp: int, cp: int, ep: int, per_node: int, training: bool, fixed: dict[str, int]) -> list[int]:
    """HSDP options: 1 (states sharded over every dp x cp rank) and shard groups of whole nodes replicated
    over the rest.  The realisation shards experts inside a group (ep divides dp_shard) and has no HSDP
    with context parallelism."""
    options = [1]
    if training and cp == 1:
        for nodes in HSDP_GROUP_NODES:
            shard, leftover = divmod(nodes * per_node, tp)
            if not leftover and shard < dp and dp % shard == 0 and shard % ep == 0:
                options.append(dp // shard)
    if "replicate" in fixed:
        r = fixed["replicate"]
        return [r] if r == 1 or (training and cp == 1 and dp % r == 0 and (dp // r) % ep == 0) else []
    return options


def _outer_rows(tp, cp, pp, dp, per_node, profile, workload, experts, fixed, rejected, space):
    """(tp, pp, dp, cp, ep, mbs, vpp, schedule, replicate) rows of one TP x CP x PP x DP layout.

    EP may leave the node here in every search space: ``plan_parallel`` ranks such layouts only once the
    space allows it, and otherwise uses them to say what keeping EP inside a node costs.
    """
    per_rank = workload.global_batch // dp
    ep_options = _divisors(math.gcd(dp * cp, *experts)) if experts and space.ep_shardable else [1]
    if experts and not space.ep_shardable and fixed.get("ep", 1) > 1:
        rejected["ep>1: adapt's runtime shards experts kept as [experts, ...] tensors only, not this model's"] += 1
    elif "ep" in fixed and fixed["ep"] > 1 and not experts:
        rejected[f"ep={fixed['ep']}: the model has no routed experts to shard"] += 1
    elif "ep" in fixed and fixed["ep"] not in ep_options:
        rejected[f"ep={fixed['ep']} must divide the experts and dp*cp={dp * cp}"] += 1
    if "mbs" in fixed and per_rank % fixed["mbs"]:
        rejected[f"mbs={fixed['mbs']} must divide the sequences per data-parallel rank (global batch / dp)"] += 1
    for ep in ep_options:
        if "ep" in fixed and fixed["ep"] != ep:
            continue
        replicas = _replicas(tp, dp, cp, ep, per_node, workload.training, fixed)
        if not replicas:
            rejected["HSDP needs cp=1 and its shard group (dp/replicate) to divide over ep"] += 1
        for mbs in (b for b in ((fixed["mbs"],) if "mbs" in fixed else MICRO_BATCHES) if per_rank % b == 0):
            pairs = [
                (v, sch)
                for v, sch in _schedules(
                    pp, per_rank // mbs, profile.num_layers, workload.training, "schedule" in fixed, fixed.get("vpp")
                )
                if fixed.get("vpp", v) == v and fixed.get("schedule", sch) == sch
            ]
            if not pairs and ("vpp" in fixed or "schedule" in fixed):
                rejected[
                    f"vpp/schedule: interleaving needs at most layers + 2 chunks and the micro-batches per step "
                    f"({per_rank // mbs} at mbs={mbs}, dp={dp}) to be a multiple of pp={pp}; DualPipe an even pp and "
                    "an even number of at least 2*pp micro-batches"
                ] += 1
            for vpp, schedule in pairs:
                yield from ((tp, pp, dp, cp, ep, mbs, vpp, schedule, r) for r in replicas)


def _expand(outer, workload: Workload, fixed: dict[str, int], space: SearchSpace):
    """Cross each group's layouts with ZeRO stage, recompute, offload and layer split, as arrays."""
    training = workload.training
    offload = (0, 1) if space.offload else (0,)
    # ZeRO-0 is dominated by ZeRO-1 (same compute, more memory, an all-reduce costing more than
    # reduce-scatter + all-gather), so the open search skips it; a pinned zero=0 is still evaluated.
    zeros = (0, 1, 2, 3) if "zero" in fixed else (1, 2, 3)
    # Sequence parallelism off moves the same collective bytes (one all-reduce for an all-gather and a
    # reduce-scatter) while every TP rank runs and keeps the norms whole, so it is dominated and the open
    # search keeps SP on, as it drops ZeRO-0; a pinned sp=0 is evaluated.  TP overlap only where the runtime
    # has it (a pinned value is evaluated); gradient reduction overlapped with backward, as FSDP2 and DDP
    # buckets do, unless pinned after the flush.  EP overlap only where the runtime has it, and then on: it
    # never exposes more of the all-to-all than running it alone and holds the same memory (a pinned 0 is evaluated).
    switches = dict(
        sp=(1,),
        tp_overlap=(0, 1) if space.tp_overlap else (0,),
        grad_overlap=(1,) if training else (0,),
        ep_overlap=(1,) if space.ep_overlap and training else (0,),
    )
    switches = {k: (fixed[k],) if k in fixed else v for k, v in switches.items()}
    inner = [
        (zero, rec, off, sp, tpo, go, epo)
        for zero, rec, off, sp, tpo, go, epo in itertools.product(
            zeros if training else (0,), range(3) if training else (0,), offload, *switches.values()
        )
        if not (off and zero == 0)
        and all(fixed.get(k, v) == v for k, v in (("zero", zero), ("recompute", rec), ("offload", off)))
    ]
    if not inner:
        return
    inner_arr = np.asarray(inner, dtype=np.int64)
    for (pp, vpp), rows in outer.items():
        base = np.asarray(rows, dtype=np.int64)
        reps = len(inner_arr)
        b = np.repeat(base, reps, axis=0)
        z = np.tile(inner_arr, (len(base), 1))
        keep = (b[:, 8] == 1) | (z[:, 0] > 0)  # replication without sharding is ZeRO-0 itself
        keep &= (b[:, 0] > 1) | (z[:, 4] == fixed.get("tp_overlap", 0))  # no TP: nothing for overlap to act on
        b, z = b[keep], z[keep]
        z[:, 3] = np.where(b[:, 0] > 1, z[:, 3], fixed.get("sp", 0))  # no TP: SP stays as pinned (off by default)
        # No EP: no all-to-all to overlap.  Megatron-Core's combined 1F1B (the runtime that brings EP overlap into
        # the open search) runs unpipelined or interleaved only; a pinned value is evaluated as given.
        combined = (b[:, 1] == 1) | (b[:, 6] > 1) | ("ep_overlap" in fixed)
        z[:, 6] = np.where((b[:, 4] > 1) & combined, z[:, 6], fixed.get("ep_overlap", 0))
        for split in range(len(SPLITS)) if pp > 1 else (0,):
            if fixed.get("split", split) != split:
                continue
            cols = dict(
                tp=b[:, 0],
                pp=b[:, 1],
                dp=b[:, 2],
                cp=b[:, 3],
                ep=b[:, 4],
                mbs=b[:, 5],
                vpp=b[:, 6],
                schedule=b[:, 7],
                zero=z[:, 0],
                recompute=z[:, 1],
                offload=z[:, 2],
                split=np.full(len(b), split, dtype=np.int64),
                replicate=b[:, 8],
                sp=z[:, 3],
                tp_overlap=z[:, 4],
                grad_overlap=z[:, 5],
                ep_overlap=z[:, 6],
            )
            yield (pp, vpp, split), Candidates(**cols)


def _schedules(
    pp: int, m: int, layers: int, training: bool, schedule_pinned: bool, vpp: int | None = None
) -> list[tuple[int, int]]:
    """(vpp, schedule) pairs.  Interleaved 1F1B holds as many activations as zero-bubble (ZB-H1) with a
    larger bubble, so the open search skips it; a pinned schedule is still evaluated, and so is a pinned
    ``vpp`` the open search does not try.  DualPipe (an even pipeline, an even number of micro-batches, at
    least two per stage) only when pinned: it keeps two copies of the parameters, and adapt cannot run it."""
    if pp == 1:
        return [(1, 0)]
    out = [(1, SCHEDULES.index("1f1b"))]
    if not training:
        return out
    if schedule_pinned and pp % 2 == 0 and m % 2 == 0 and m >= 2 * pp:  # DualPipe's own checks (``DualPipe.step``)
        out.append((1, SCHEDULES.index("dualpipe")))
    interleaved = ("interleaved_1f1b", "zero_bubble") if schedule_pinned else ("zero_bubble",)
    for v in (vpp,) if vpp and vpp > 1 else VIRTUAL_STAGES[1:]:
        if pp * v <= layers + 2 and m % pp == 0:  # interleaving needs whole rounds of pp micro-batches
            out += [(v, SCHEDULES.index(name)) for name in interleaved]
    return out
