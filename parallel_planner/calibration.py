"""Measured per-block timings that replace the compute model (the throughput stage emits them).

Format (JSON)::

    {"device": "NVIDIA H200", "dtype": "bf16", "seq_len": 4096, "micro_batch": 1,
     "hidden_size": 4096, "tokens": 4096,
     "blocks": [{"index": 0, "forward_s": 0.0012, "backward_s": 0.0025},
                {"signature": "<BlockSpec.signature()>", "forward_s": ..., "backward_s": ...}]}

Times are for one block, one micro-batch of ``micro_batch x seq_len`` tokens, on one GPU without
model parallelism.  A block is matched by ``signature`` or by layer ``index``.  The planner divides
the measured forward+backward time by its own prediction at that same shape; the ratio rescales the
block type's compute at every other shape (TP shard, CP chunk, micro-batch) the search explores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adapt.core.errors import BadInput
from parallel_planner.cluster import Cluster
from parallel_planner.profile import ModelProfile
from parallel_planner.workload import Workload


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


def load_calibration(path: str | Path) -> Calibration:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise BadInput(f"calibration {path}: cannot read JSON ({err})") from None
    try:
        blocks = tuple(
            BlockTiming(float(b["forward_s"]), float(b["backward_s"]), b.get("index"), b.get("signature"))
            for b in data["blocks"]
        )
        cal = Calibration(
            device=str(data["device"]), dtype=str(data.get("dtype", "bf16")), seq_len=int(data["seq_len"]),
            micro_batch=int(data.get("micro_batch", 1)), blocks=blocks, hidden_size=data.get("hidden_size"),
            tokens=data.get("tokens"), source=str(path),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise BadInput(f"calibration {path}: missing or malformed field ({err})") from None
    if not blocks or any(b.forward_s <= 0 or b.backward_s <= 0 or (b.index is None and not b.signature) for b in blocks):
        raise BadInput(f"calibration {path}: every block needs positive forward_s/backward_s and an index or signature")
    return cal


def compute_scale(
    cal: Calibration, profile: ModelProfile, cluster: Cluster, workload: Workload, eff
) -> np.ndarray:
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
    return scale
