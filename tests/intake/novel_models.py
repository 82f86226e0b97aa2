"""Models written for the tests the way a new lab might write them: own module names, no HF conventions.

- ``Weave``: a hybrid stack whose layer list alternates two layer classes (attention, then a gated
  depthwise-convolution mixer), experts kept as a ``ModuleList`` of separate MLPs in the attention layers.
- ``tide``: attention alternating with a gated linear recurrence (a decay loop in plain torch).
- The attention (``Glance``) keeps its head counts in a tuple no config name or attribute exposes, with
  separate q/k/v projections and fewer KV heads, and rotates q and k with rotary written out as
  ``x1*cos - x2*sin`` (no ``rotate_half``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, GROUPS, SPAN, VOCAB, SPECIALISTS = 48, 4, 2, 12, 97, 6


def turn(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary written out: pairs (i, i + d/2) rotated with x1*cos - x2*sin, x2*cos + x1*sin."""
    half = q.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)

    def one(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    return one(q), one(k)


class Clock(nn.Module):
    def __init__(self, span: int):
        super().__init__()
        self.register_buffer("rates", 1.0 / (1000.0 ** (torch.arange(0, span, 2).float() / span)), persistent=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32)
        angles = torch.outer(positions, self.rates)[None]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


class Glance(nn.Module):
    def __init__(self):
        super().__init__()
        self.plan = (HEADS, GROUPS, SPAN)  # unreadable as head counts by name
        self.seek = nn.Linear(WIDTH, HEADS * SPAN, bias=False)
        self.hold = nn.Linear(WIDTH, GROUPS * SPAN, bias=False)
        self.give = nn.Linear(WIDTH, GROUPS * SPAN, bias=False)
        self.fold = nn.Linear(HEADS * SPAN, WIDTH, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        heads, groups, span = self.plan
        b, t, _ = h.shape
        q = self.seek(h).view(b, t, heads, span).transpose(1, 2)
        k = self.hold(h).view(b, t, groups, span).transpose(1, 2)
        v = self.give(h).view(b, t, groups, span).transpose(1, 2)
        q, k = turn(q, k, cos, sin)
        k, v = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
        scores = q @ k.transpose(-1, -2) / span**0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.fold(out.transpose(1, 2).reshape(b, t, heads * span))


class Scale(nn.Module):
    """RMS normalisation under another name."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(WIDTH))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.gain * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class Specialist(nn.Module):
    def __init__(self, inner: int = 32):
        super().__init__()
        self.lift = nn.Linear(WIDTH, inner, bias=False)
        self.valve = nn.Linear(WIDTH, inner, bias=False)
        self.drop = nn.Linear(inner, WIDTH, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(F.silu(self.valve(h)) * self.lift(h))


class Council(nn.Module):
    """Experts as a ModuleList of separate MLPs; top-2 sigmoid routing."""

    def __init__(self):
        super().__init__()
        self.chooser = nn.Linear(WIDTH, SPECIALISTS, bias=False)
        self.members = nn.ModuleList([Specialist() for _ in range(SPECIALISTS)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, WIDTH)
        weights, chosen = torch.sigmoid(self.chooser(flat)).topk(2, dim=-1)
        out = torch.zeros_like(flat)
        for slot in range(2):
            for index, member in enumerate(self.members):
                rows = chosen[:, slot] == index
                if rows.any():
                    out[rows] += weights[rows, slot, None] * member(flat[rows])
        return out.view_as(h)


class Ripple(nn.Module):
    """A gated depthwise causal convolution as the token mixer."""

    def __init__(self, kernel: int = 4):
        super().__init__()
        self.entry = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.smear = nn.Conv1d(WIDTH, WIDTH, kernel, groups=WIDTH, padding=kernel - 1)
        self.exit = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x, gate = self.entry(h).chunk(2, dim=-1)
        x = self.smear(x.transpose(1, 2))[..., : h.shape[1]].transpose(1, 2)
        return self.exit(x * torch.sigmoid(gate))


class Ebb(nn.Module):
    """A gated linear recurrence: a per-channel decay loop over the positions, in plain torch."""

    def __init__(self):
        super().__init__()
        self.intake = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.decay = nn.Parameter(torch.zeros(WIDTH))
        self.outlet = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x, gate = self.intake(h).chunk(2, dim=-1)
        keep = torch.sigmoid(self.decay)
        state = torch.zeros_like(x[:, 0])
        outputs = []
        for t in range(h.shape[1]):
            state = keep * state + (1 - keep) * x[:, t]
            outputs.append(state)
        return self.outlet(torch.stack(outputs, dim=1) * F.silu(gate))


class EbbLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = Scale()
        self.ebb = Ebb()
        self.mid = Scale()
        self.feed = Specialist(64)

    def forward(self, h, cos, sin):
        h = h + self.ebb(self.pre(h))
        return h + self.feed(self.mid(h))


class LookLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = Scale()
        self.look = Glance()
        self.mid = Scale()
        self.council = Council()

    def forward(self, h, cos, sin):
        h = h + self.look(self.pre(h), cos, sin)
        return h + self.council(self.mid(h))


class RippleLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = Scale()
        self.ripple = Ripple()
        self.mid = Scale()
        self.feed = Specialist(64)

    def forward(self, h, cos, sin):
        h = h + self.ripple(self.pre(h))
        return h + self.feed(self.mid(h))


class Weave(nn.Module):
    """Hybrid stack: look, ripple, look, ripple."""

    def __init__(self, layers: tuple[type[nn.Module], ...] = (LookLayer, RippleLayer, LookLayer, RippleLayer)):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB, model_type="weave")
        self.lexicon = nn.Embedding(VOCAB, WIDTH)
        self.clock = Clock(SPAN)
        self.strands = nn.ModuleList([layer() for layer in layers])
        self.last = Scale()
        self.readout = nn.Linear(WIDTH, VOCAB, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.lexicon

    def get_output_embeddings(self) -> nn.Linear:
        return self.readout

    def can_generate(self) -> bool:
        return True

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        h = self.lexicon(input_ids)
        cos, sin = self.clock(input_ids)
        for strand in self.strands:
            h = strand(h, cos, sin)
        logits = self.readout(self.last(h))
        if labels is None:
            return (logits,)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def weave(seed: int = 0) -> Weave:
    torch.manual_seed(seed)
    return Weave().eval()


def tide(seed: int = 0) -> Weave:
    """Attention alternating with a gated linear recurrence."""
    torch.manual_seed(seed)
    return Weave((LookLayer, EbbLayer)).eval()


class TokenStack(nn.Module):
    """Token ids -> an embedding table -> the given layers, with the least a loader-free model offers intake: a
    ``config`` with its vocabulary, ``get_input_embeddings`` and, when asked, a claim that it generates."""

    def __init__(self, vocab: int, width: int, layers: list[nn.Module], generates: bool = False) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab)
        self.table = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(layers)
        self.generates = generates

    def get_input_embeddings(self) -> nn.Embedding:
        return self.table

    def can_generate(self) -> bool:
        return self.generates

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.table(input_ids)
        for layer in self.layers:
            h = layer(h)
        return h
