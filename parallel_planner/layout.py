"""Candidate layouts as columns of arrays, and the layer split of a pipeline over its stages.

The search scores tens of thousands of layouts at once, so a batch of candidates is a struct of
NumPy arrays (one entry per candidate) and the models in ``memory``/``timing`` are written over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallel_planner.profile import ModelProfile

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble", "dualpipe")
# light_ends: the first and the last chunk hold one layer fewer, for the embedding and the head; with as
# many chunks as layers + 2 they hold the embedding or the head alone (Llama 3 405B's pipeline).
SPLITS = ("balanced", "light_ends")
FIELDS = (
    "tp",
    "pp",
    "dp",
    "cp",
    "ep",
    "zero",
    "recompute",
    "mbs",
    "vpp",
    "schedule",
    "offload",
    "split",
    "replicate",
    "sp",
    "tp_overlap",
    "grad_overlap",
    "ep_overlap",
)


@dataclass
class Candidates:
    """Columns of candidate layouts; ``recompute``/``schedule``/``split`` hold indices into the tuples above."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    cp: np.ndarray
    ep: np.ndarray
    zero: np.ndarray
    recompute: np.ndarray
    mbs: np.ndarray
    vpp: np.ndarray
    schedule: np.ndarray
    offload: np.ndarray
    split: np.ndarray
    replicate: np.ndarray  # HSDP: data-parallel replicas of each shard group (1: shard over all dp x cp ranks)
    sp: np.ndarray  # sequence parallelism (norms, residuals and their activations sharded over TP); 0/1
    tp_overlap: np.ndarray  # TP collectives pipelined with the GEMMs beside them (Megatron --tp-comm-overlap); 0/1
    grad_overlap: np.ndarray  # gradient reduction overlapped with backward (1) or issued after the flush (0)
    ep_overlap: np.ndarray  # EP all-to-all run beside another micro-batch's compute (DualPipe, combined 1F1B); 0/1

    @classmethod
    def from_rows(cls, rows: list[tuple[int, ...]]) -> Candidates:
        table = np.asarray(rows, dtype=np.int64).reshape(-1, len(FIELDS))
        return cls(*(table[:, i].copy() for i in range(len(FIELDS))))

    def __len__(self) -> int:
        return len(self.tp)

    @property
    def shard(self) -> np.ndarray:
        """Ranks that shard the model states (ZeRO/FSDP): dp_shard x cp."""
        return self.dp // self.replicate * self.cp

    def take(self, index: np.ndarray) -> Candidates:
        return Candidates(*(getattr(self, f)[index] for f in FIELDS))

    def row(self, i: int) -> dict[str, int]:
        return {f: int(getattr(self, f)[i]) for f in FIELDS}


def mirrored(per_stage: np.ndarray, dual: np.ndarray, mean: bool) -> np.ndarray:
    """Per-stage figures as DualPipe's devices see them, (C, pp): device i holds stage i and stage pp-1-i, so it
    holds their sum, and a micro-batch costs it their mean (half the micro-batches run each way).  Rows not under
    DualPipe keep their stages (as given, when none is).  ``per_stage`` holds every physical stage in order (an
    uncompressed layout)."""
    if not dual.any():
        return per_stage
    per_stage = np.broadcast_to(per_stage, (len(dual), per_stage.shape[-1]))
    pair = per_stage + per_stage[:, ::-1]
    return np.where(dual[:, None], pair / 2 if mean else pair, per_stage)


def row_max(a: np.ndarray) -> np.ndarray:
    """Maximum of each row of a (candidates, few columns) array.  NumPy reduces short rows one at a time,
    ~20x slower than folding the columns together, which is what the search does most."""
    if a.shape[1] > 8:
        return a.max(axis=1)
    out = a[:, 0].copy()
    for j in range(1, a.shape[1]):
        np.maximum(out, a[:, j], out=out)
    return out


@dataclass(frozen=True)
class StageLayout:
    """Blocks per virtual stage, and per physical stage the count of each block type it holds.

    The per-stage arrays may be *compressed*: stages with identical contents collapse onto the first of
    them (which holds the most micro-batches in flight, so memory maxima are kept) and ``multiplicity``
    says how many stages each column stands for (so pipeline sums are kept).
    """

    chunk_layers: tuple[int, ...]  # pp * vpp entries; chunk j runs on physical stage j % pp
    type_counts: np.ndarray  # (stages, n_block_types)
    has_embedding: np.ndarray  # (stages,) 0/1
    has_head: np.ndarray  # (stages,) 0/1
    stage_ids: np.ndarray  # physical stage index of each column
    multiplicity: np.ndarray  # stages each column stands for
    pp: int

    def compressed(self) -> StageLayout:
        contents = np.concatenate([self.type_counts, self.has_embedding[:, None], self.has_head[:, None]], axis=1)
        _, first, counts = np.unique(contents, axis=0, return_index=True, return_counts=True)
        keep = np.sort(first)
        weight = counts[np.argsort(first)]
        return StageLayout(
            self.chunk_layers,
            self.type_counts[keep],
            self.has_embedding[keep],
            self.has_head[keep],
            self.stage_ids[keep],
            weight.astype(np.float64),
            self.pp,
        )


def split_layers(num_layers: int, chunks: int, split: str) -> list[int] | None:
    """Contiguous layer counts per virtual stage; None when the layers cannot fill every chunk."""
    light = 1 if split == "light_ends" and chunks > 1 else 0
    slots = num_layers + 2 * light  # the two end chunks act as if they held one phantom layer each
    if slots < chunks:
        return None
    base, extra = divmod(slots, chunks)
    counts = [base] * chunks
    middle = list(range(1, chunks - 1)) or list(range(chunks))
    for j in range(extra):  # remainder goes to middle chunks first: the ends carry embedding and head
        counts[middle[j % len(middle)]] += 1
    if light:
        counts[0] -= 1
        counts[-1] -= 1
    if min(counts[light : chunks - light], default=1) < 1 or min(counts) < 0:
        return None
    return counts


def stage_layout(profile: ModelProfile, pp: int, vpp: int, split: str) -> StageLayout | None:
    chunks = split_layers(profile.num_layers, pp * vpp, split)
    if chunks is None:
        return None
    counts = np.zeros((pp, len(profile.blocks)), dtype=np.float64)
    start = 0
    for j, n in enumerate(chunks):
        types = profile.layer_types[start : start + n]
        np.add.at(counts[j % pp], types, 1.0)
        start += n
    embed = np.zeros(pp)
    head = np.zeros(pp)
    embed[0] = 1.0
    head[(pp * vpp - 1) % pp] = 1.0
    return StageLayout(tuple(chunks), counts, embed, head, np.arange(pp), np.ones(pp), pp)
