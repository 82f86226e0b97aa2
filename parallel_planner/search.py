"""Search the layout space and rank what fits: ``plan_parallel``.

Every structurally valid layout (TP x CP x PP x DP over the GPUs, EP inside DP x CP, ZeRO stage,
HSDP shard groups of whole nodes, recompute, micro-batch, virtual stages, schedule, layer split,
optimizer offload, sequence parallelism, TP- and EP-communication overlap where the runtime has it, gradient
reduction overlapped or after the flush) is scored at once by the vectorised memory and time models,
grouped by pipeline split. TP and EP stay inside a node and optimizer states on the GPU; only when nothing fits does the
search add offload, then cross-node TP/EP (a faster cross-node-EP layout is still reported as the
binding constraint). ``fixed`` pins any subset of the knobs; the rest are chosen for the fastest
fitting result; ``nvlink_domain``, ``nvlink_gbps`` and ``inter_gbps`` pin the network per level.  A pinned
layout is always evaluated (even where the search would skip it as a duplicate split), and a pinned set
that admits no layout is refused naming the knobs whose release would admit one.  ``search_space`` enumerates
the layouts; this module scores and ranks them and says what binds.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from adapt.core.errors import BadInput
from adapt.core.spec import ModelSpec
from parallel_planner.calibration import Calibration, compute_scale, measured_on
from parallel_planner.catalog import GIB
from parallel_planner.cluster import Cluster
from parallel_planner.efficiency import Efficiency
from parallel_planner.kernel_rates import slowest_gpu_pace
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
from parallel_planner.profile import ModelProfile, profile_model, with_prediction_modules
from parallel_planner.result import KNOB_KEYS, PlannerResult, RankedPlan
from parallel_planner.search_space import SearchSpace, enumerate_candidates
from parallel_planner.timing import step_time
from parallel_planner.workload import Workload


def with_network(cluster: Cluster, gpus_per_node: int | None = None, **bandwidths: float) -> Cluster:
    """The cluster with its NVLink domain size and per-level bandwidths (GB/s per GPU) replaced."""
    per_node = int(gpus_per_node or cluster.gpus_per_node)
    gpu = dataclasses.replace(cluster.gpu, gpus_per_node=per_node, **bandwidths)
    return Cluster(gpu, cluster.num_gpus, min(per_node, cluster.num_gpus))


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
        if not (cands.schedule == SCHEDULES.index("dualpipe")).any():  # DualPipe pairs stages by position
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
    mm = memory_model or MemoryModel.of(eff)
    product = math.prod(pinned.get(k, 1) for k in ("tp", "pp", "dp", "cp"))
    if cluster.num_gpus % product or (
        all(k in pinned for k in ("tp", "pp", "dp", "cp")) and product != cluster.num_gpus
    ):
        factors = [f"{k}={pinned[k]}" for k in ("tp", "pp", "dp", "cp") if k in pinned]
        times = " x ".join(factors) + (f" = {product}" if len(factors) > 1 else "")
        raise BadInput(f"--fixed: {times} does not lay out {cluster.num_gpus} GPUs")
    profile = with_prediction_modules(profile_model(spec), workload.mtp_depth)
    scale = compute_scale(calibration, profile, cluster, workload, eff) if calibration else None
    space_overlap = "tp_overlap" in pinned
    usable = mm.usable_bytes(cluster)
    overlap = dict(
        tp_overlap=eff.runtime == "megatron" or space_overlap,
        ep_overlap=(eff.runtime == "megatron" and profile.max_experts > 0) or "ep_overlap" in pinned,
        ep_shardable=eff.runtime != "torch" or all(b.expert_layout in ("", "bank") for b in profile.blocks),
    )
    spaces = (
        SearchSpace(**overlap),
        SearchSpace(offload=True, **overlap),
        SearchSpace(cross_node=True, offload=True, **overlap),
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
    if cluster.num_gpus > 1 and eff.gpu_spread:
        pace = slowest_gpu_pace(cluster.num_gpus, eff.gpu_spread)
        notes.append(
            f"compute time x{pace:.3f}: a synchronous step waits for the slowest of {cluster.num_gpus} GPUs, whose "
            f"speeds spread {eff.gpu_spread:.0%} under power management (docs/planner-model.md, slowest GPU)"
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
