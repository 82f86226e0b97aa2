"""Which layer made a generation step diverge: per-layer hidden states at that one step.

Every block and component output is recorded (``validators.modules.probes``) at the failing step's
last position, in the two modes the failed check compared, and the same for the unadapted model in
the same dtype, whose own difference is the yardstick.  The first probe, in execution order, whose
candidate difference exceeds ``max_err_ratio`` times the yardstick plus the dtype's floor is named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from validators.compare import Thresholds, tensor_error
from validators.generation_steps import Divergence, cached_steps, logits_of
from validators.modules import Recording, find_blocks, probes, record_outputs


def _at_step(tensor: torch.Tensor, rows: int, row: int) -> torch.Tensor:
    """One row's hidden state at the last position (MoE internals come flattened over tokens)."""
    if tensor.dim() >= 3 and tensor.shape[0] == rows:
        return tensor[row, -1]
    if tensor.dim() == 2 and tensor.shape[0] % rows == 0 and tensor.shape[0] >= rows:
        return tensor.view(rows, -1, tensor.shape[-1])[row, -1]
    return tensor.flatten()


def _record_uncached(model: nn.Module, ids: torch.Tensor, device: str) -> dict[str, Any]:
    with record_outputs(probes(model, find_blocks(model))) as rec:
        logits_of(model, input_ids=ids.view(1, -1).to(device), use_cache=False)
    return _extract(rec, 1, 0)


def _record_cached(
    model: nn.Module, seqs: list[torch.Tensor], lens: list[int], step: int, row: int, device: str
) -> dict[str, Any] | None:
    holder: list[Recording] = []

    @contextlib.contextmanager
    def on_step(index: int) -> Iterator[None]:
        if index != step:
            yield
            return
        with record_outputs(probes(model, find_blocks(model))) as rec:
            holder.append(rec)
            yield

    logits, _ = cached_steps(model, seqs, lens, step + 1, device, on_step)
    return _extract(holder[0], len(seqs), row) if logits is not None and holder else None


def _extract(rec: Recording, rows: int, row: int) -> dict[str, Any]:
    return {key: (_at_step(t, rows, row), rec.where[key]) for key, t in rec.outputs.items()}


def _rel(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    if key not in a or key not in b or a[key][0].shape != b[key][0].shape:
        return None
    return tensor_error(b[key][0], a[key][0]).rel_err


def name_layer(
    first: Divergence,
    models: dict[str, nn.Module],
    traced: list[tuple[torch.Tensor, torch.Tensor]],
    lengths: list[int],
    limits: Thresholds,
    device: str,
) -> None:
    """Fill in ``first.layer`` (and its block and error) from hidden states at the diverging step."""
    prompt, step = first.prompt, first.step
    full_ids = traced[prompt][0].cpu()
    n = lengths[prompt]
    prefix = full_ids[: n + step]
    reference, baseline, candidate = models["reference"], models["baseline"], models["candidate"]
    ref_device = str(next(reference.parameters()).device)
    ref_full = _record_uncached(reference, prefix, ref_device)
    base_full, cand_full = _record_uncached(baseline, prefix, device), _record_uncached(candidate, prefix, device)
    base_cached = _record_cached(baseline, [full_ids], [n], step, 0, device) or base_full
    cand_cached = _record_cached(candidate, [full_ids], [n], step, 0, device) or cand_full
    if first.check == "cache":
        pairs = [(cand_cached, cand_full), (base_cached, base_full), (base_full, ref_full)]
    elif first.check == "batch":
        seqs = [t[0].cpu() for t in traced]
        cand_batch = _record_cached(candidate, seqs, lengths, step, prompt, device) or cand_cached
        base_batch = _record_cached(baseline, seqs, lengths, step, prompt, device) or base_cached
        pairs = [(cand_batch, cand_cached), (base_batch, base_cached), (base_cached, ref_full)]
    else:
        pairs = [(cand_cached, ref_full), (base_cached, ref_full), (base_full, ref_full)]
    (cand_a, cand_b), *yardsticks = pairs
    for key, (_, where) in cand_a.items():
        err = _rel(cand_a, cand_b, key)
        base = [e for e in (_rel(a, b, key) for a, b in yardsticks) if e is not None]
        if err is None or not base:
            continue
        if not err <= limits.max_err_ratio * max(base) + limits.rel_err_floor:
            first.layer, first.block, first.layer_rel_err = key, where.block, err
            return
    first.detail += "; no single layer's hidden state stands out at this step"
