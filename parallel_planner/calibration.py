"""Measurements of the target machine that replace the time model's assumptions: the loop closes here.

Format (JSON; every section optional but at least one of blocks, runs, gemm_efficiency, dispatch)::

    {"schema": "adapt.calibration", "schema_version": 1,     # optional; checked when present
     "device": "NVIDIA H200", "dtype": "bf16",              # what was measured, in which element type
     "gemm_efficiency": 0.79,                 # achieved bf16 GEMM FLOP/s / dense peak
     "matmul_tflops": 781.0, "peak_tflops": 989.0,          # the achieved rate and the peak it is a share of
     "dispatch": {"eager_s": 1.2e-5, "dtensor_s": 9e-5, "compiled_s": 3e-6},   # measure_dispatch_costs()
     "runs": [{"gpus": 1, "layout": {"tp": 1, "zero": 3, "mbs": 4}, "seq_len": 2048, "global_batch": 4,
               "tokens_per_s": 42892, "step_time_s": 0.191, "peak_memory_gib": 39.5, "mfu": 0.35}],
     "seq_len": 4096, "micro_batch": 1, "hidden_size": 4096, "tokens": 4096,
     "blocks": [{"index": 0, "forward_s": 0.0012, "backward_s": 0.0025},
                {"signature": "<BlockSpec.signature()>", "forward_s": ..., "backward_s": ...}]}

``adapt run``'s throughput stage writes this file as ``artifacts/throughput/calibration.json`` (the adapted
model's training step on this one device as a run, the achieved GEMM rate, per-block timings; see
``validators.throughput.planner_calibration``) and ``adapt plan --calibration FILE`` reads it.

``gemm_efficiency`` replaces the catalogue's GEMM ceiling; ``dispatch`` the host cost per operator.
``runs`` are whole training steps the throughput stage measured: the planner scales its compute so that
its prediction of each listed layout meets the measured step (the median over runs), which carries
what no term models (clocks under load, framework overheads) to every other layout.  ``blocks`` are
per-block timings for one block, one micro-batch of ``micro_batch x seq_len`` tokens, on one GPU
without model parallelism, matched by ``signature`` or layer ``index``; each rescales its block type.
Measured peak memory (``runs[].peak_memory_gib``), ``step_time_s``, ``mfu`` and ``matmul_tflops`` are kept
and reported beside the prediction, not folded into the models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adapt.core.errors import BadInput
from adapt.core.inputs import read_input_text
from parallel_planner.cluster import Cluster
from parallel_planner.profile import ModelProfile
from parallel_planner.workload import Workload

SCHEMA, SCHEMA_VERSION = "adapt.calibration", 1


@dataclass(frozen=True)
class BlockTiming:
    forward_s: float
    backward_s: float
    index: int | None = None
    signature: str | None = None


@dataclass(frozen=True)
class Calibration:
    device: str
    dtype: str
    seq_len: int
    micro_batch: int
    blocks: tuple[BlockTiming, ...]
    hidden_size: int | None = None
    tokens: int | None = None
    source: str = field(default="", compare=False)
    gemm_efficiency: float | None = None
    dispatch: dict | None = None
    runs: tuple[dict, ...] = ()

    def apply(self, eff, cluster: Cluster | None = None):
        """``eff`` with the measured GEMM rate and host costs in place of the assumed ones."""
        import dataclasses

        changes: dict = {}
        if self.gemm_efficiency and cluster is not None:
            changes["gemm_scale"] = self.gemm_efficiency / cluster.gpu.gemm_ceiling
        if self.dispatch:
            changes["host"] = dataclasses.replace(eff.host, **self.dispatch, source=f"calibration {self.source}")
        return dataclasses.replace(eff, **changes) if changes else eff


def measured_on(device: str, gpu) -> bool:
    """Whether a device name (``NVIDIA H100 80GB HBM3``) is the catalogue GPU type the plan targets."""
    return gpu.name.lower() in device.lower().replace(" ", "").replace("-", "")


def load_calibration(path: str | Path) -> Calibration:
    path = Path(path)
    try:
        data = json.loads(read_input_text(path, "calibration"))
    except json.JSONDecodeError as err:
        raise BadInput(f"calibration {path}: cannot read JSON ({err})") from None
    return calibration_from_dict(data, str(path))


def calibration_from_dict(data: dict, source: str = "") -> Calibration:
    """A ``Calibration`` from its JSON form; malformed or empty content is bad input."""
    where = f"calibration {source}" if source else "calibration"
    if not isinstance(data, dict):
        raise BadInput(f"{where}: expected a JSON object")
    if data.get("schema", SCHEMA) != SCHEMA or data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise BadInput(
            f"{where}: schema {data.get('schema')!r} version {data.get('schema_version')!r}; "
            f"this adapt reads {SCHEMA!r} version {SCHEMA_VERSION}"
        )
    try:
        blocks = tuple(
            BlockTiming(float(b["forward_s"]), float(b["backward_s"]), b.get("index"), b.get("signature"))
            for b in data.get("blocks") or ()
        )
        dispatch = {
            k: float(v) for k, v in (data.get("dispatch") or {}).items() if k in ("eager_s", "dtensor_s", "compiled_s")
        }
        runs = tuple(
            dict(
                r,
                gpus=int(r["gpus"]),
                seq_len=int(r["seq_len"]),
                global_batch=int(r["global_batch"]),
                tokens_per_s=float(r["tokens_per_s"]),
            )
            for r in data.get("runs") or ()
        )
        cal = Calibration(
            device=str(data["device"]),
            dtype=str(data.get("dtype", "bf16")),
            seq_len=int(data.get("seq_len") or 0),
            micro_batch=int(data.get("micro_batch", 1)),
            blocks=blocks,
            hidden_size=data.get("hidden_size"),
            tokens=data.get("tokens"),
            source=source,
            gemm_efficiency=float(data["gemm_efficiency"]) if data.get("gemm_efficiency") else None,
            dispatch=dispatch or None,
            runs=runs,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise BadInput(f"{where}: missing or malformed field ({err})") from None
    if not (blocks or runs or cal.gemm_efficiency or cal.dispatch):
        raise BadInput(f"{where}: no blocks, runs, gemm_efficiency or dispatch to calibrate with")
    if blocks and (
        not cal.seq_len
        or any(b.forward_s <= 0 or b.backward_s <= 0 or (b.index is None and not b.signature) for b in blocks)
    ):
        raise BadInput(
            f"{where}: every block needs positive forward_s/backward_s and an index or signature, "
            "and the file a seq_len"
        )
    if any(r["tokens_per_s"] <= 0 or r["gpus"] < 1 for r in runs) or any(v <= 0 for v in dispatch.values()):
        raise BadInput(f"{where}: runs need gpus >= 1 and positive tokens_per_s; dispatch costs must be positive")
    if cal.gemm_efficiency is not None and not 0 < cal.gemm_efficiency <= 1:
        raise BadInput(f"{where}: gemm_efficiency must be in (0, 1], got {cal.gemm_efficiency}")
    return cal


def calibration_from_measurements(
    device: str,
    gemm_tflops: float | None,
    peak_tflops: float | None,
    dispatch: dict | None,
    runs: list[dict],
    *,
    dtype: str = "bf16",
    shape: dict | None = None,
    blocks: list[dict] | None = None,
) -> dict:
    """The calibration JSON (see the module docstring) from what was measured: the one writer of the format.

    ``shape`` holds ``seq_len``, ``micro_batch``, ``hidden_size`` and ``tokens`` of the ``blocks`` timings.
    """
    data: dict = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "device": device, "dtype": dtype}
    data.update(shape or {})
    data["runs"] = list(runs)
    if gemm_tflops:
        data["matmul_tflops"] = gemm_tflops
    if gemm_tflops and peak_tflops:
        data["peak_tflops"] = peak_tflops
        data["gemm_efficiency"] = min(1.0, gemm_tflops / peak_tflops)
    if dispatch:
        data["dispatch"] = {k: v for k, v in dispatch.items() if k in ("eager_s", "dtensor_s", "compiled_s")}
    if blocks:
        data["blocks"] = list(blocks)
    return data


def compute_scale(cal: Calibration, profile: ModelProfile, cluster: Cluster, workload: Workload, eff) -> np.ndarray:
    """Measured / modelled compute time per block type; 1 where the calibration says nothing."""
    from parallel_planner.timing import block_forward_seconds

    if cal.hidden_size and cal.hidden_size != profile.hidden:
        raise BadInput(f"calibration hidden size {cal.hidden_size} does not match the model's {profile.hidden}")
    tokens = cal.micro_batch * cal.seq_len
    measured: dict[int, list[float]] = {}
    for timing in cal.blocks:
        if timing.signature is not None:
            if timing.signature not in profile.signatures:
                raise BadInput("calibration names a block signature this model does not have")
            kind = profile.signatures.index(timing.signature)
        else:
            if not 0 <= int(timing.index) < profile.num_layers:
                raise BadInput(f"calibration block index {timing.index} is outside 0..{profile.num_layers - 1}")
            kind = int(profile.layer_types[int(timing.index)])
        measured.setdefault(kind, []).append(timing.forward_s + timing.backward_s)
    scale = np.ones(len(profile.blocks))
    one = np.ones(1, dtype=np.int64)
    for kind, values in measured.items():
        block = profile.blocks[kind]
        ctx = profile.attention_context(block, cal.seq_len)
        gemm, attention, elementwise = block_forward_seconds(
            block, np.array([float(tokens)]), one, one, ctx, cluster, workload.precision, eff
        )
        modelled = float(3 * gemm[0] + 3.5 * attention[0] + 3 * elementwise[0])
        scale[kind] = float(np.median(values)) / modelled
    if cal.runs:
        scale = scale * float(np.median([_run_scale(run, profile, cluster, workload, eff, scale) for run in cal.runs]))
    return scale


RUN_DEFAULTS = dict(
    tp=1,
    pp=1,
    cp=1,
    ep=1,
    zero=1,
    recompute="none",
    mbs=1,
    vpp=1,
    schedule="1f1b",
    offload=0,
    split="balanced",
    replicate=1,
    tp_overlap=0,
    grad_overlap=1,
    ep_overlap=0,
)


def _run_scale(run: dict, profile: ModelProfile, cluster: Cluster, workload: Workload, eff, scale: np.ndarray) -> float:
    """The compute scale at which the model's step for a measured run equals the measured step."""
    measured = run["global_batch"] * run["seq_len"] / run["tokens_per_s"]
    low, high = 0.05, 20.0
    for _ in range(40):  # the step grows with the compute scale: bisect on a log scale
        mid = (low * high) ** 0.5
        below = run_step_seconds(run, profile, cluster, workload, eff, scale * mid) < measured
        low, high = (mid, high) if below else (low, mid)
    return (low * high) ** 0.5


def run_step_seconds(
    run: dict, profile: ModelProfile, cluster: Cluster, workload: Workload, eff, scale: np.ndarray | None = None
) -> float:
    """The time model's step for a measured run's layout, GPUs and shape (``scale``: compute per block type)."""
    from parallel_planner.timing import step_time

    one, layout, run_cluster, run_workload = _run_layout(run, profile, cluster, workload)
    return float(step_time(profile, run_cluster, run_workload, one, layout, eff, scale)["step"][0])


def run_memory_gib(run: dict, profile: ModelProfile, cluster: Cluster, workload: Workload, memory_model) -> float:
    """The memory model's fullest stage for a measured run, to report beside its measured peak."""
    from parallel_planner.catalog import GIB
    from parallel_planner.memory import memory_breakdown

    one, layout, run_cluster, run_workload = _run_layout(run, profile, cluster, workload)
    return float(
        memory_breakdown(profile, run_cluster, run_workload, one, layout, memory_model)["total"][0].max() / GIB
    )


def _run_layout(run: dict, profile: ModelProfile, cluster: Cluster, workload: Workload):
    """A measured run as one candidate, its layer split, and the cluster and workload it ran on.  The layout
    is taken as given, whatever the search would enumerate (a bench's micro-batch of 6, ZeRO-0 on one GPU)."""
    import dataclasses

    from parallel_planner.knobs import parse_fixed
    from parallel_planner.layout import FIELDS, SPLITS, Candidates, stage_layout

    knobs = parse_fixed({**RUN_DEFAULTS, **(run.get("layout") or {})})
    knobs.setdefault("sp", int(knobs["tp"] > 1))
    knobs.setdefault("dp", run["gpus"] // (knobs["tp"] * knobs["pp"] * knobs["cp"]))
    if knobs["dp"] * knobs["tp"] * knobs["pp"] * knobs["cp"] != run["gpus"]:
        raise BadInput(f"calibration run {run.get('layout')} does not lay out {run['gpus']} GPUs")
    one = Candidates.from_rows([tuple(knobs[f] for f in FIELDS)])
    layout = stage_layout(profile, knobs["pp"], knobs["vpp"], SPLITS[knobs["split"]])
    if layout is None:
        raise BadInput(f"calibration run {run.get('layout')}: the layers do not fill its pipeline")
    run_cluster = dataclasses.replace(cluster, num_gpus=run["gpus"])
    run_workload = dataclasses.replace(workload, seq_len=run["seq_len"], global_batch=run["global_batch"])
    return one, layout, run_cluster, run_workload
