"""Running a model one generated token at a time, with its cache and without, and the record of a first divergence:
what the generation check and its layer diagnosis share."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from adapt.model.calls import library_failure
from adapt.model.skeleton import quiet_transformers
from validators.decode import accepts, cache_keyword, returned_cache
from validators.modules import first_tensor


class CacheRefused(RuntimeError):
    """The model's own code (or transformers') raised while decoding with its cache: the reason, on one line."""


@dataclass
class Divergence:
    """The first step that failed a check, where, and which layer's hidden state went wrong first."""

    check: str  # one of CHECKS
    prompt: int
    step: int  # new-token index, from 0
    position: int  # position of the generated token in its sequence (prompt length + step)
    detail: str
    layer: str | None = None
    block: int | None = None
    layer_rel_err: float | None = None

    def describe(self) -> str:
        where = f"{self.check} at prompt {self.prompt} step {self.step} (position {self.position})"
        return where + (f", first divergent layer {self.layer}" if self.layer else "") + f": {self.detail}"


def logits_of(model: nn.Module, cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The model's logits and its cache (None when it keeps none); ``cache`` goes in under the forward's name."""
    if cache is not None:
        kwargs[cache_keyword(model)] = cache
    with quiet_transformers():
        out = model(**kwargs)
    logits = first_tensor(out)
    if logits is None:
        raise RuntimeError("the model returned no tensor")
    return logits, returned_cache(out)


def greedy_reference(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation without a cache, as recomputing the whole prefix every step gives it.  Returns (ids, step
    logits).

    The model's own cache proposes the continuation (one token a step), and one forward over the whole sequence,
    without a cache, checks it: causal, that forward's logits at each position are the prefix's alone, so the
    proposal stands as far as its argmax agrees with every proposed token.  From the first step where it does not
    (a cache that decodes differently, a near-tie), the rest is recomputed prefix by prefix, as it all was before:
    a float64 reference of a state-space model took minutes on a CPU that way."""
    seq = prompt.view(1, -1)
    proposed = _cached_greedy(model, seq, new_tokens)
    if proposed is None:
        return _prefix_by_prefix(model, seq, new_tokens, [])
    n = seq.shape[1]
    logits, _ = logits_of(model, input_ids=proposed[:, : n + new_tokens - 1], use_cache=False)
    steps = logits[0, n - 1 :].double().cpu()
    agree = steps.argmax(-1) == proposed[0, n:].cpu()
    kept = new_tokens if bool(agree.all()) else int(agree.int().argmin())
    if kept == new_tokens:
        return proposed[0], steps
    return _prefix_by_prefix(model, proposed[:, : n + kept], new_tokens - kept, list(steps[:kept]))


def _prefix_by_prefix(
    model: nn.Module, seq: torch.Tensor, new_tokens: int, steps: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_tokens`` more greedy tokens after ``seq``, each from a forward over the whole prefix (no cache)."""
    for _ in range(new_tokens):
        logits, _ = logits_of(model, input_ids=seq, use_cache=False)
        steps.append(logits[0, -1].double().cpu())
        seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)
    return seq[0], torch.stack(steps)


def _cached_greedy(model: nn.Module, seq: torch.Tensor, new_tokens: int) -> torch.Tensor | None:
    """The greedy continuation by the model's own cached decoding: a proposal only, so a model that keeps no cache,
    or whose cache code raises, proposes nothing (None) and the reference recomputes every prefix instead."""
    try:
        logits, past = logits_of(model, input_ids=seq, use_cache=True)
        for _ in range(new_tokens - 1):
            if past is None:
                return None
            seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)
            logits, past = logits_of(model, past, input_ids=seq[:, -1:], use_cache=True)
    except Exception:  # noqa: BLE001 - any failure of the cached path leaves the uncached one, which decides
        return None
    return torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)


def uncached_steps(
    model: nn.Module, full_ids: torch.Tensor, prompt_len: int, new_tokens: int, device: str
) -> torch.Tensor:
    """Step logits from one forward over the teacher sequence without a cache (causal: one prefix per step)."""
    ids = full_ids[: prompt_len + new_tokens - 1].view(1, -1).to(device)
    logits, _ = logits_of(model, input_ids=ids, use_cache=False)
    return logits[0, prompt_len - 1 :].double().cpu()


def cached_steps(
    model: nn.Module,
    sequences: list[torch.Tensor],
    prompt_lens: list[int],
    new_tokens: int,
    device: str,
    on_step: Any = None,
) -> tuple[torch.Tensor | None, Any]:
    """Step logits ``[rows, new_tokens, vocab]`` from prefill plus cached decode, teacher-forced.

    Several sequences run as one left-padded batch with an attention mask and explicit positions.
    ``on_step(step)`` may return a context manager that wraps that step's forward (diagnosis records
    hidden states through it).  Returns (None, note) when the model keeps no cache.
    """
    rows, longest = len(sequences), max(prompt_lens)
    ids = torch.zeros(rows, longest, dtype=torch.long)
    mask = torch.zeros(rows, longest, dtype=torch.long)
    for r, (seq, n) in enumerate(zip(sequences, prompt_lens)):
        ids[r, longest - n :], mask[r, longest - n :] = seq[:n], 1
    ids, mask = ids.to(device), mask.to(device)
    padded = rows > 1 and min(prompt_lens) < longest
    kwargs: dict[str, Any] = {"attention_mask": mask} if padded else {}
    positions = accepts(model, "position_ids")
    if padded and positions:
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    steps, past = [], None
    for step in range(new_tokens):
        if step:
            next_ids = torch.stack([seq[n + step - 1] for seq, n in zip(sequences, prompt_lens)]).view(rows, 1)
            ids = next_ids.to(device)
            if padded:
                mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
                kwargs["attention_mask"] = mask
                if positions:
                    kwargs["position_ids"] = torch.tensor([[n + step - 1] for n in prompt_lens], device=device)
        with on_step(step) if on_step is not None else contextlib.nullcontext():
            try:
                logits, past = logits_of(model, past, input_ids=ids, use_cache=True, **kwargs)
            except Exception as err:
                reason = library_failure(model, err)
                if reason is None:
                    raise
                raise CacheRefused(reason) from err
        if past is None:
            return None, "the model returns no cache: decode recomputes the prefix, no cache to check"
        steps.append(logits[:, -1].double().cpu())
    note = (
        None
        if positions or not padded
        else "the model takes no position_ids: left-padded rows are positioned by the cache"
    )
    return torch.stack(steps, dim=1), note


# ---- judging -----------------------------------------------------------------------------------
