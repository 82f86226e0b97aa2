"""Search the layout space and rank what fits: ``plan_parallel``.

Every structurally valid layout (TP x CP x PP x DP over the GPUs, EP inside DP x CP, ZeRO stage,
HSDP shard groups of whole nodes, recompute, micro-batch, virtual stages, schedule, layer split,
optimizer offload, sequence parallelism, TP-communication overlap where the runtime has it, gradient
reduction overlapped or after the flush) is scored at once by the vectorised memory and time models,
grouped by pipeline split. TP and EP stay inside a node and optimizer states on the GPU; only when nothing fits does the
search add offload, then cross-node TP/EP (a faster cross-node-EP layout is still reported as the
binding constraint). ``fixed`` pins any subset of the knobs; the rest are chosen for the fastest
fitting result; ``nvlink_domain``, ``nvlink_gbps`` and ``inter_gbps`` pin the network per level.  A pinned
layout is always evaluated (even where the search would skip it as a duplicate split), and a pinned set
that admits no layout is refused naming the knobs whose release would admit one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from adapt.core.errors import BadInput
from adapt.core.spec import ModelSpec
from parallel_planner.calibration import Calibration, compute_scale, measured_on
from parallel_planner.catalog import GIB
from parallel_planner.cluster import Cluster
from parallel_planner.knobs import NETWORK_KEYS, parse_fixed
from parallel_planner.launch import launch_command
from parallel_planner.layout import (
    FIELDS,
    RECOMPUTE,
    SCHEDULES,
    SPLITS,
    Candidates,
    row_max,
    stage_layout,
)
from parallel_planner.memory import MemoryModel, memory_breakdown, model_state_floor
from parallel_planner.plan import ParallelPlan
from parallel_planner.profile import ModelProfile, profile_model
from parallel_planner.result import KNOB_KEYS, PlannerResult, RankedPlan
from parallel_planner.timing import Efficiency, step_time
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


def with_network(cluster: Cluster, gpus_per_node: int | None = None, **bandwidths: float) -> Cluster:
    """The cluster with its NVLink domain size and per-level bandwidths (GB/s per GPU) replaced."""
    per_node = int(gpus_per_node or cluster.gpus_per_node)
    gpu = dataclasses.replace(cluster.gpu, gpus_per_node=per_node, **bandwidths)
    return Cluster(gpu, cluster.num_gpus, min(per_node, cluster.num_gpus))


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
                for row in _outer_rows(tp, cp, pp, dp, per_node, profile, workload, experts, fixed, rejected):
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


def _outer_rows(tp, cp, pp, dp, per_node, profile, workload, experts, fixed, rejected):
    """(tp, pp, dp, cp, ep, mbs, vpp, schedule, replicate) rows of one TP x CP x PP x DP layout.

    EP may leave the node here in every search space: ``plan_parallel`` ranks such layouts only once the
    space allows it, and otherwise uses them to say what keeping EP inside a node costs.
    """
    per_rank = workload.global_batch // dp
    ep_options = _divisors(math.gcd(dp * cp, *experts)) if experts else [1]
    if "ep" in fixed and fixed["ep"] not in ep_options:
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
                    f"({per_rank // mbs} at mbs={mbs}, dp={dp}) to be a multiple of pp={pp}"
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
    # buckets do, unless pinned after the flush.
    switches = dict(sp=(1,), tp_overlap=(0, 1) if space.tp_overlap else (0,), grad_overlap=(1,) if training else (0,))
    switches = {k: (fixed[k],) if k in fixed else v for k, v in switches.items()}
    inner = [
        (zero, rec, off, sp, tpo, go)
        for zero, rec, off, sp, tpo, go in itertools.product(
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
            )
            yield (pp, vpp, split), Candidates(**cols)


def _schedules(
    pp: int, m: int, layers: int, training: bool, schedule_pinned: bool, vpp: int | None = None
) -> list[tuple[int, int]]:
    """(vpp, schedule) pairs.  Interleaved 1F1B holds as many activations as zero-bubble (ZB-H1) with a
    larger bubble, so the open search skips it; a pinned schedule is still evaluated, and so is a pinned
    ``vpp`` the open search does not try."""
    if pp == 1:
        return [(1, 0)]
    out = [(1, SCHEDULES.index("1f1b"))]
    if not training:
        return out
    interleaved = ("interleaved_1f1b", "zero_bubble") if schedule_pinned else ("zero_bubble",)
    for v in (vpp,) if vpp and vpp > 1 else VIRTUAL_STAGES[1:]:
        if pp * v <= layers + 2 and m % pp == 0:  # interleaving needs whole rounds of pp micro-batches
            out += [(v, SCHEDULES.index(name)) for name in interleaved]
    return out


@dataclass
class Scored:
    candidates: Candidates
    memory_total: np.ndarray  # bytes on the fullest stage
    step: np.ndarray
    smallest_pruned: float = np.inf  # least model-state floor among layouts pruned before scoring


def score(
    profile: ModelProfile,
    cluster: Cluster,
    workload: Workload,
    groups: dict[tuple[int, int, int], Candidates],
    eff: Efficiency,
    mm: MemoryModel,
    scale: np.ndarray | None,
    prune: bool = True,
    dedupe: bool = True,
) -> Scored:
    """Fullest-stage memory and step time of every candidate, one (pp, vpp, split) group at a time.

    With ``prune``, layouts whose model states alone overflow the GPU are dropped before scoring.
    """
    parts: list[tuple[Candidates, np.ndarray, np.ndarray]] = []
    usable = mm.usable_bytes(cluster) if prune else np.inf
    smallest_pruned = np.inf
    for (pp, vpp, split), cands in groups.items():
        layout = stage_layout(profile, pp, vpp, SPLITS[split])
        if layout is None or (
            dedupe
            and split
            and layout.chunk_layers == getattr(stage_layout(profile, pp, vpp, SPLITS[0]), "chunk_layers", None)
        ):
            continue  # no layer split, or (searching) the same split under another name
        layout = layout.compressed()
        floor = model_state_floor(profile, workload, cands, mm)
        possible = floor <= usable
        if not possible.all():
            smallest_pruned = min(smallest_pruned, float(floor[~possible].min()))
            if not possible.any():
                continue
            cands = cands.take(np.flatnonzero(possible))
        memory = row_max(memory_breakdown(profile, cluster, workload, cands, layout, mm)["total"])
        parts.append((cands, memory, step_time(profile, cluster, workload, cands, layout, eff, scale)["step"]))
    if not parts:
        return Scored(Candidates.from_rows([]), np.zeros(0), np.zeros(0), smallest_pruned)
    cands = Candidates(*(np.concatenate([getattr(p[0], f) for p in parts]) for f in FIELDS))
    return Scored(cands, np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]), smallest_pruned)


def plan_parallel(
    spec: ModelSpec,
    cluster: Cluster,
    workload: Workload,
    fixed: dict | str | None = None,
    top_k: int = 5,
    calibration: Calibration | None = None,
    efficiency: Efficiency | None = None,
    memory_model: MemoryModel | None = None,
) -> PlannerResult:
    """Rank the fastest layouts that fit, or evaluate a fixed one (``fixed`` pins knobs, see ``parse_fixed``)."""
    eff = efficiency or Efficiency()
    rejected, notes = Counter(), []
    pinned = parse_fixed(fixed)
    pinned_network = {k: pinned.pop(k) for k in list(pinned) if k in NETWORK_KEYS}
    network = {NETWORK_KEYS[k]: v for k, v in pinned_network.items()}
    if network:
        cluster = with_network(cluster, **network)
    if calibration is not None:
        eff = calibration.apply(eff, cluster)
        if not measured_on(calibration.device, cluster.gpu):
            notes.append(f"the calibration was measured on {calibration.device}, not on {cluster.gpu.name.upper()}")
    mm = memory_model or MemoryModel(fused_kernels=eff.fused_kernels)
    product = math.prod(pinned.get(k, 1) for k in ("tp", "pp", "dp", "cp"))
    if cluster.num_gpus % product or (
        all(k in pinned for k in ("tp", "pp", "dp", "cp")) and product != cluster.num_gpus
    ):
        factors = [f"{k}={pinned[k]}" for k in ("tp", "pp", "dp", "cp") if k in pinned]
        times = " x ".join(factors) + (f" = {product}" if len(factors) > 1 else "")
        raise BadInput(f"--fixed: {times} does not lay out {cluster.num_gpus} GPUs")
    profile = profile_model(spec)
    scale = compute_scale(calibration, profile, cluster, workload, eff) if calibration else None
    space_overlap = "tp_overlap" in pinned
    usable = mm.usable_bytes(cluster)
    overlap = eff.runtime == "megatron" or space_overlap
    spaces = (
        SearchSpace(tp_overlap=overlap),
        SearchSpace(offload=True, tp_overlap=overlap),
        SearchSpace(cross_node=True, offload=True, tp_overlap=overlap),
    )
    for space in spaces:
        groups, rejected_here = enumerate_candidates(profile, cluster, workload, pinned, space)
        rejected += rejected_here
        scored = score(
            profile, cluster, workload, groups, eff, mm, scale, prune=not pinned, dedupe="split" not in pinned
        )
        c = scored.candidates
        allowed = (c.ep * c.tp <= cluster.gpus_per_node) | space.cross_node | ("ep" in pinned)
        if ((scored.memory_total <= usable) & allowed).any():
            break
    if space is not spaces[0] and not pinned and (scored.memory_total <= usable).any():
        notes.append(
            "nothing fitted with TP/EP inside a node and optimizer states on the GPU; the search widened"
            if space.cross_node
            else "nothing fitted with optimizer states on the GPU; offload joined the search"
        )
    if not len(scored.candidates):
        if np.isfinite(scored.smallest_pruned):
            raise BadInput(
                f"no layout fits in {usable / GIB:.1f} GiB per {cluster.gpu.name}: parameters, gradients and "
                f"optimizer states alone need at least {scored.smallest_pruned / GIB:.1f} GiB; use more GPUs"
            )
        raise BadInput(
            _no_layout_message(
                cluster, workload, rejected, pinned, _blocking_knobs(profile, cluster, workload, pinned, spaces[-1])
            )
        )
    fits_anywhere = scored.memory_total <= usable
    fits = fits_anywhere & allowed
    if not fits.any() and not pinned:
        smallest = int(np.argmin(scored.memory_total))
        raise BadInput(
            f"no layout fits in {usable / GIB:.1f} GiB per {cluster.gpu.name}: the smallest needs "
            f"{scored.memory_total[smallest] / GIB:.1f} GiB ({_short(scored.candidates.row(smallest))}); "
            "use more GPUs, a larger GPU or a shorter sequence"
        )
    pool = np.flatnonzero(fits) if fits.any() else np.arange(len(fits))  # a pinned layout may not fit: say so
    order = pool[np.argsort(scored.step[pool], kind="stable")][:top_k]
    binding = _binding(scored, fits, fits_anywhere | ~allowed, usable, int(order[0]), rejected)
    wide = np.flatnonzero(fits_anywhere & ~allowed & (scored.step < scored.step[order[0]] / 1.05))
    if len(wide) and fits.any():
        i = int(wide[np.argmin(scored.step[wide])])
        binding = (
            f"expert parallelism kept inside a node: {_short(scored.candidates.row(i))} is predicted "
            f"{scored.step[order[0]] / scored.step[i]:.2f}x faster with EP across nodes (pass it with --fixed)"
        )
    plans = [
        _ranked(rank, scored.candidates.row(int(i)), profile, cluster, workload, eff, mm, scale, spec.source)
        for rank, i in enumerate(order, 1)
    ]
    return PlannerResult(
        plans=plans,
        binding_constraint=binding,
        searched=len(scored.candidates),
        feasible=int(fits.sum()),
        fixed={**{k: _knob_name(k, v) for k, v in pinned.items()}, **pinned_network} or None,
        cluster=cluster.to_dict(),
        workload=workload.to_dict(),
        efficiency=eff.to_dict(),
        calibration=calibration.device if calibration else None,
        notes=notes,
    )


def _knob_name(key: str, value: int):
    names = {"recompute": RECOMPUTE, "schedule": SCHEDULES, "split": SPLITS}.get(key)
    return names[value] if names else value


def _short(row: dict[str, int]) -> str:
    return ",".join(f"{k}={_knob_name(k, v)}" for k, v in row.items())


def _binding(
    scored: Scored, fits: np.ndarray, memory_ok: np.ndarray, usable: float, best: int, rejected: Counter
) -> str:
    """What stops a faster plan: memory if faster layouts overflow it, else the commonest structural limit."""
    if not fits[best]:
        return f"memory: needs {scored.memory_total[best] / GIB:.1f} GiB of {usable / GIB:.1f} GiB usable"
    faster = np.flatnonzero((scored.step < scored.step[best]) & ~memory_ok)
    if len(faster):
        quickest = faster[np.argmin(scored.step[faster])]
        return (
            f"memory: {len(faster)} faster layouts exceed {usable / GIB:.1f} GiB usable per GPU; the fastest "
            f"({_short(scored.candidates.row(int(quickest)))}) needs {scored.memory_total[quickest] / GIB:.1f} GiB"
        )
    if rejected:
        reason, count = rejected.most_common(1)[0]
        return f"{reason} ({count} layout families excluded)"
    return "none: the fastest layout in the space fits"


def _blocking_knobs(profile, cluster: Cluster, workload: Workload, pinned: dict, space: SearchSpace) -> str:
    """What makes a pinned layout impossible, as the knobs to release: each one whose release alone admits a
    layout; else the knobs no layout admits even alone; else a smallest set found by pinning the knobs back one
    at a time while some layout still exists."""
    names = {k: f"{k}={_knob_name(k, v)}" for k, v in pinned.items()}
    alone = [names[k] for k in pinned if _admits(profile, cluster, workload, _without(pinned, (k,)), space)]
    if alone:
        return f"releasing {' or '.join(alone)} would admit one"
    impossible = [names[k] for k, v in pinned.items() if not _admits(profile, cluster, workload, {k: v}, space)]
    if impossible:
        return f"{' and '.join(impossible)} admit{'s' if len(impossible) == 1 else ''} no layout even alone"
    kept: dict = {}
    for key, value in pinned.items():
        if _admits(profile, cluster, workload, {**kept, key: value}, space):
            kept[key] = value
    released = [names[k] for k in pinned if k not in kept]
    return f"releasing {', '.join(released)} together would admit one" if kept != pinned else ""


def _without(pinned: dict, keys: tuple[str, ...]) -> dict:
    return {k: v for k, v in pinned.items() if k not in keys}


def _admits(profile, cluster: Cluster, workload: Workload, pinned: dict, space: SearchSpace) -> bool:
    groups, _ = enumerate_candidates(profile, cluster, workload, pinned, space)
    return any(
        len(cands) and stage_layout(profile, pp, vpp, SPLITS[split]) is not None
        for (pp, vpp, split), cands in groups.items()
    )


def _no_layout_message(
    cluster: Cluster, workload: Workload, rejected: Counter, pinned: dict, blocking: str = ""
) -> str:
    if pinned:  # what the open enumeration skipped for knobs nobody pinned is noise here
        about_pinned = Counter({r: c for r, c in rejected.items() if any(k in r for k in pinned)})
        rejected = about_pinned or rejected
    reasons = "; ".join(f"{r} ({c})" for r, c in rejected.most_common(2 if blocking else 3))
    what = f"the fixed layout {_short(pinned)}" if pinned else f"{cluster.num_gpus} x {cluster.gpu.name}"
    head = f"no valid layout for {what} with global batch {workload.global_batch}: "
    if pinned and blocking:  # the knobs first: they are what the user can change
        return head + blocking + (f" ({reasons})" if reasons else "")
    return head + (reasons or "the fixed knobs admit no layout")


def _ranked(
    rank, row: dict[str, int], profile, cluster: Cluster, workload: Workload, eff, mm, scale, profile_source: str
) -> RankedPlan:
    """Re-evaluate one layout with every breakdown kept."""
    one = Candidates.from_rows([tuple(row[f] for f in FIELDS)])
    layout = stage_layout(profile, row["pp"], row["vpp"], SPLITS[row["split"]])
    memory = memory_breakdown(profile, cluster, workload, one, layout, mm)
    times = step_time(profile, cluster, workload, one, layout, eff, scale)
    fullest = int(memory["total"][0].argmax())
    m = workload.global_batch // (row["mbs"] * row["dp"])
    plan = ParallelPlan(
        tp=row["tp"],
        pp=row["pp"],
        cp=row["cp"],
        ep=row["ep"],
        zero=row["zero"],
        dp_replicate=row["dp"] if row["zero"] == 0 else row["replicate"],
        dp_shard=1 if row["zero"] == 0 else row["dp"] // row["replicate"],
        sequence_parallel=row["tp"] > 1 and bool(row["sp"]),
        recompute=RECOMPUTE[row["recompute"]],
        micro_batch=row["mbs"],
        grad_accum=m,
        pp_schedule=SCHEDULES[row["schedule"]],
        vpp=row["vpp"],
        stage_layers=list(layout.chunk_layers) if row["pp"] > 1 else [],
        offload_optimizer=bool(row["offload"]),
        vocab_parallel=row["tp"] > 1,
        seq_len=workload.seq_len,
        global_batch=workload.global_batch,
        precision=workload.precision,
        gpus_per_node=cluster.gpus_per_node,
    )
    step = float(times["step"][0])
    tokens_per_s = workload.tokens_per_step / step
    peak = cluster.gpu.peak_flops("bf16") * cluster.num_gpus
    model_flops = profile.model_flops_per_token(workload.seq_len, workload.training)
    total = float(memory["total"][0, fullest])
    return RankedPlan(
        rank=rank,
        plan=plan,
        fits=total <= mm.usable_bytes(cluster),
        memory_gib_per_gpu=total / GIB,
        memory_breakdown={k: float(v[0, fullest] / GIB) for k, v in memory.items() if k != "total"},
        memory_per_stage_gib=[round(float(x / GIB), 3) for x in memory["total"][0]],
        usable_memory_gib=mm.usable_bytes(cluster) / GIB,
        step_time_s=step,
        time_breakdown={
            k: float(v[0]) for k, v in times.items() if k not in ("step", "hardware_flops_per_token", "host_bound")
        },
        host_bound=bool(times["host_bound"][0]),
        knobs={k: _knob_name(k, row[k]) for k in KNOB_KEYS},
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=tokens_per_s / cluster.num_gpus,
        mfu=model_flops * tokens_per_s / peak,
        hfu=float(times["hardware_flops_per_token"][0]) * tokens_per_s / peak,
        torchrun=launch_command(plan, cluster.gpus_per_node, profile_source) if workload.training else "",
    )
