"""Checkpoint metadata from safetensors headers, without reading tensor data.

The header format is public and tiny: an 8-byte little-endian length, then a JSON object
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``.  Reading it ourselves lets us
validate every shard (truncation, corrupt headers, inconsistent offsets) before any loader
touches it, and name the broken file in the error.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from adapt.core.errors import BadInput
from adapt.core.spec import CheckpointReport, TensorInfo

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_MAX_HEADER = 100 << 20


def read_safetensors_header(path: str | os.PathLike) -> list[TensorInfo]:
    """Names, shapes, dtypes and byte sizes of every tensor in one shard; raises BadInput if corrupt."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise BadInput(f"{path}: truncated safetensors file ({size} bytes, no header)")
        header_len = int.from_bytes(head, "little")
        if header_len > _MAX_HEADER or 8 + header_len > size:
            raise BadInput(
                f"{path}: corrupt or truncated safetensors file (header claims {header_len} bytes, file has {size})"
            )
        raw = fh.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadInput(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise BadInput(f"{path}: corrupt safetensors header (not an object)")
    data_size = size - 8 - header_len
    tensors = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], list(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"{path}: corrupt safetensors header entry for {name!r}") from None
        if dtype not in DTYPE_BYTES:
            raise BadInput(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - begin != nbytes or begin < 0:
            raise BadInput(
                f"{path}: tensor {name!r} has offsets [{begin}, {end}] inconsistent with shape {shape} {dtype}"
            )
        if end > data_size:
            raise BadInput(
                f"{path}: truncated safetensors file: tensor {name!r} ends at byte {end} but only {data_size} data bytes exist"
            )
        tensors.append(TensorInfo(name=name, shape=shape, dtype=dtype, nbytes=nbytes, file=path.name))
    return tensors


def read_checkpoint(files: Iterable[str]) -> dict[str, TensorInfo]:
    """Headers of all shards, keyed by tensor name; duplicated names across shards are an error."""
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        for info in read_safetensors_header(file):
            if info.name in tensors:
                raise BadInput(f"{file}: tensor {info.name!r} also appears in {tensors[info.name].file}")
            tensors[info.name] = info
    return tensors


def expected_checkpoint_tensors(model: torch.nn.Module) -> dict[str, list[int]]:
    """Names and shapes the checkpoint should hold for ``model`` (a meta skeleton), in on-disk layout.

    transformers >= 5 fuses some weights at load time (e.g. per-expert linears into one 3-D tensor)
    and reverts that on save; we ask transformers' own ``revert_weight_conversion`` for the on-disk
    names so the comparison is like for like.
    """
    return _shapes(_on_disk_state(model))


INTEGER_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")  # safetensors' names


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {name: list(t.shape) for name, t in state.items()}


def _on_disk_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The skeleton's state dict under on-disk names (tied names still share one tensor object)."""
    state = dict(model.state_dict(keep_vars=True))
    try:
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, state)
    except ImportError:  # older layout without conversions: names are already on-disk names
        pass
    return state


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. tied input/output embeddings)."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def on_disk_tied_groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """``tied_groups`` of an on-disk state (``_on_disk_state``): a multimodal wrapper saves its tied head as
    ``language_model.lm_head.weight`` while the module tree calls it ``lm_head.weight``."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def cross_check(
    model: torch.nn.Module,
    tensors: dict[str, TensorInfo],
    files: list[str],
    fmt: str = "safetensors",
    quantization: dict[str, Any] | None = None,
) -> CheckpointReport:
    """Compare checkpoint headers with the skeleton: missing, unexpected and mismatched keys, ties.

    ``quantization`` (the config's ``quantization_config``): the weights are stored in the quantisation's own form,
    so a tensor beside a module's weights (its scales, zero points), a weight of another shape (packed integers)
    and a weight replaced by such tensors are the quantisation's, not unused, mismatched or missing."""
    state = _on_disk_state(model)  # transformers' name reversion, once
    expected = _shapes(state)
    ties = tied_groups(model)
    disk_ties = on_disk_tied_groups(state)
    tied_followers = {name for group in ties + disk_ties for name in group[1:]}
    tied_followers |= {name for group in ties + disk_ties for name in group if name not in tensors}

    # Some checkpoints (base models saved without the task head) omit a prefix: align on suffixes.
    prefix = _common_prefix_shift(expected, tensors)
    aligned = {prefix + name: info for name, info in tensors.items()} if prefix else dict(tensors)

    missing = sorted(n for n in expected if n not in aligned and n not in tied_followers)
    # A tie group needs at least one member present in the checkpoint (named as on disk).
    for group in disk_ties:
        if not any(n in aligned for n in group):
            missing.append(group[0])
    unexpected = sorted(n for n in aligned if n not in expected)
    mismatches = [
        {"name": n, "checkpoint": aligned[n].shape, "model": expected[n]}
        for n in sorted(aligned)
        if n in expected and list(aligned[n].shape) != list(expected[n])
    ]
    integer_for_float = [
        {"name": n, "checkpoint": aligned[n].dtype, "model": str(state[n].dtype).removeprefix("torch.")}
        for n in sorted(aligned)
        if n in state and aligned[n].dtype in INTEGER_DTYPES and state[n].dtype.is_floating_point
    ]
    stored: list[str] = []
    if quantization:
        owners = {name.rsplit(".", 1)[0] for name in expected}
        stored = sorted({n for n in unexpected if n.rsplit(".", 1)[0] in owners} | {m["name"] for m in mismatches})
        quantised_modules = {name.rsplit(".", 1)[0] for name in stored}
        unexpected = [n for n in unexpected if n not in stored]
        mismatches = [m for m in mismatches if m["name"] not in stored]
        missing = [n for n in missing if n.rsplit(".", 1)[0] not in quantised_modules]
    return CheckpointReport(
        format=fmt,  # type: ignore[arg-type]
        files=[os.path.basename(f) for f in files],
        num_tensors=len(tensors),
        num_elements=sum(math.prod(t.shape) for t in tensors.values()),
        total_bytes=sum(t.nbytes for t in tensors.values()),
        dtypes=dict(Counter(t.dtype for t in tensors.values())),
        missing=sorted(set(missing)),
        unexpected=unexpected,
        shape_mismatches=mismatches,
        tied=[sorted(g) for g in ties],
        integer_for_float=integer_for_float,
        quantization=dict(quantization or {}),
        quantization_tensors=stored,
    )


def _common_prefix_shift(expected: dict[str, list[int]], tensors: dict[str, TensorInfo]) -> str:
    """The prefix (e.g. ``"model."``) to add to checkpoint names so they match the skeleton, or ``""``."""
    if not tensors or any(n in expected for n in tensors):
        return ""
    sample = next(iter(tensors))
    for name in expected:
        if name.endswith("." + sample):
            prefix = name[: -len(sample)]
            if sum(prefix + n in expected for n in tensors) > len(tensors) // 2:
                return prefix
    return ""
