"""Routing-aware comparison of mixture-of-experts layers.

A routed MoE sends each token to the top-k experts of its router scores.  When the k-th and the
(k+1)-th score of a token are closer than the dtype's rounding, a bf16 model may pick a different
expert than the float64 reference: the token then takes another path through the network and its
hidden state, and everything computed from it, differs by O(1).  That is a property of the dtype
and the draw, not of the kernels: it happens in the unadapted model too, on other tokens.

So every ``topk`` a block component calls is recorded (a ``TorchFunctionMode``; no class names,
no per-model tables).  A token is *undecidable* in the dtype when the reference's margin between its
last chosen and first unchosen score is within the rounding the unadapted model shows on such
boundary scores: ``max |baseline - reference|`` over every token's last-chosen and first-unchosen
score in the call, times the thresholds' ``max_err_ratio``.  Boundary scores only, since the top
scores of a wide softmax router carry far larger absolute errors and would excuse every token;
the whole call, since one token's two scores are too few to estimate the rounding from.
Undecidable tokens are left out of the error metrics of that block and every later tensor (their
path may differ from there on), counted in each affected ``LayerResult`` and in the notes, whether or
not a flip was seen: a kernel may route inside its own code while the module's ``topk`` still runs,
so the ``topk`` seen in the candidate is reported but never trusted to clear a token.  Tokens on a
clear margin are always judged, and where the candidate's ``topk`` shows one of them routed
differently the note says so: a kernel that routes wrongly still fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from validators.modules import Probe

_TOPK = {torch.topk, torch.Tensor.topk}


@dataclass
class TopkCall:
    """One ``topk`` over router-like scores: the scores (rows x candidates, float64) and the chosen set."""

    scores: torch.Tensor
    chosen: torch.Tensor  # rows x k, sorted expert indices


@dataclass
class RoutingRecording:
    calls: dict[tuple[str, int], TopkCall] = field(default_factory=dict)  # (component, n-th call) -> call
    block_of: dict[str, int | None] = field(default_factory=dict)


class _TopkRecorder(TorchFunctionMode):
    def __init__(self, recording: RoutingRecording, stack: list[str]):
        super().__init__()
        self.recording, self.stack = recording, stack
        self.counts: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _TOPK and self.stack:
            scores, k = args[0], (args[1] if len(args) > 1 else kwargs["k"])
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            owner = self.stack[-1]
            n = self.counts.get(owner, 0)
            self.counts[owner] = n + 1
            rows = scores.detach().movedim(dim, -1)
            chosen = out[1].detach().movedim(dim, -1)
            self.recording.calls[(owner, n)] = TopkCall(
                rows.reshape(-1, rows.shape[-1]).to("cpu", torch.float64),
                chosen.reshape(-1, int(k)).sort(-1).values.cpu(),
            )
        return out


@contextlib.contextmanager
def record_routing(points: list[tuple[Probe, nn.Module]]) -> Iterator[RoutingRecording]:
    """Record every ``topk`` the block components in ``points`` run (first call of each component)."""
    recording = RoutingRecording()
    stack: list[str] = []
    handles = []

    def enter(name: str):
        def hook(_module, _args) -> None:
            stack.append(name)

        return hook

    def leave(_module, _args, _output) -> None:
        stack.pop()

    for probe, module in points:
        if probe.component is None:
            continue
        recording.block_of[probe.name] = probe.block
        handles.append(module.register_forward_pre_hook(enter(probe.name)))
        handles.append(module.register_forward_hook(leave))
    try:
        with _TopkRecorder(recording, stack):
            yield recording
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class RoutingFlips:
    """Per block: tokens the dtype cannot route for sure (left out), and clear-margin flips seen in the candidate."""

    tokens: int
    excused: dict[int, set[int]] = field(default_factory=dict)  # block -> undecidable token indices (near ties)
    clear: dict[int, int] = field(default_factory=dict)  # block -> flipped tokens on a clear margin
    clear_margin: dict[int, tuple[float, float]] = field(default_factory=dict)  # block -> (smallest margin, rounding)

    def excluded_from(self, block: int | None) -> set[int]:
        """Tokens left out of a tensor of ``block`` (None: outside the blocks, after them: the logits)."""
        return set().union(*(t for b, t in self.excused.items() if block is None or b <= block))

    def notes(self) -> list[str]:
        out = []
        for block, tokens in sorted(self.excused.items()):
            out.append(
                f"block {block}: {len(tokens)} token(s) on a near-tied router score (margin within the unadapted "
                "model's rounding: their expert choice is undecidable in this dtype); left out of that block's and later tensors' errors"
            )
        for block, count in sorted(self.clear.items()):
            margin, rounding = self.clear_margin[block]
            out.append(
                f"block {block}: {count} token(s) routed differently on a clear router margin "
                f"(smallest {margin:.3g} > rounding {rounding:.3g}; judged, not excused)"
            )
        return out


def routing_flips(
    reference: RoutingRecording, baseline: RoutingRecording, candidate: RoutingRecording, tokens: int, ratio: float
) -> RoutingFlips:
    """Undecidable tokens per block and clear-margin flips seen in the candidate (see the module docstring)."""
    flips = RoutingFlips(tokens)
    tainted: set[int] = set()
    for key in sorted(reference.calls, key=lambda k: (reference.block_of.get(k[0]) or 0, k[1])):
        ref, base, cand = reference.calls[key], baseline.calls.get(key), candidate.calls.get(key)
        k = ref.chosen.shape[1]
        if (
            base is None
            or ref.scores.shape != base.scores.shape
            or ref.scores.shape[0] % tokens
            or k >= ref.scores.shape[1]
        ):
            continue
        per_token = ref.scores.shape[0] // tokens
        block = reference.block_of.get(key[0])
        top = ref.scores.topk(k + 1, dim=-1)
        margin = (top.values[:, k - 1] - top.values[:, k]).nan_to_num(nan=0.0)  # -inf vs -inf (masked out) is a tie
        rounding = ratio * _boundary_rounding(ref.scores, base.scores, top.indices[:, k - 1 :])
        near = margin <= rounding
        undecided = {row // per_token for row in near.nonzero().flatten().tolist()} - tainted
        if undecided:
            flips.excused.setdefault(block, set()).update(undecided)
        if cand is not None and cand.chosen.shape == ref.chosen.shape:
            wrong = (cand.chosen != ref.chosen).any(-1) & ~near
            for row in wrong.nonzero().flatten().tolist():
                if row // per_token not in tainted:
                    flips.clear[block] = flips.clear.get(block, 0) + 1
                    smallest = min(float(margin[row]), flips.clear_margin.get(block, (float("inf"), 0.0))[0])
                    flips.clear_margin[block] = (smallest, rounding)
        tainted |= undecided
    return flips


def _boundary_rounding(reference: torch.Tensor, baseline: torch.Tensor, boundary: torch.Tensor) -> float:
    """max |baseline - reference| over the ``boundary`` scores (rows x 2 indices) both hold finite
    (masked-out ones are -inf)."""
    ref, base = reference.gather(1, boundary), baseline.gather(1, boundary)
    finite = torch.isfinite(ref) & torch.isfinite(base)
    return float((base - ref)[finite].abs().max()) if bool(finite.any()) else 0.0


def drop_tokens(tensor: torch.Tensor, excluded: set[int], tokens: int) -> torch.Tensor:
    """``tensor`` without the rows of ``excluded`` tokens ([batch, seq, ...] or [tokens, ...] layouts)."""
    if not excluded:
        return tensor
    if tensor.dim() >= 2 and tensor.shape[0] * tensor.shape[1] == tokens:
        flat = tensor.reshape(tokens, *tensor.shape[2:])
    elif tensor.dim() >= 1 and tensor.shape[0] == tokens:
        flat = tensor
    else:
        return tensor
    keep = torch.ones(tokens, dtype=torch.bool)
    keep[sorted(excluded)] = False
    return flat[keep.to(flat.device)]
