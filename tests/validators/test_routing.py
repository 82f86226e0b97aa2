"""Routing-aware comparison: near-tie tokens are left out and counted, clear-margin flips are judged."""

from __future__ import annotations

import torch
from torch import nn

from validators.modules import Probe
from validators.routing import (
    RoutingRecording,
    TopkCall,
    drop_tokens,
    record_routing,
    routing_flips,
)


def _recording(scores: torch.Tensor, k: int = 2, block: int = 1) -> RoutingRecording:
    rec = RoutingRecording()
    rec.block_of["layers.1.moe"] = block
    rec.calls[("layers.1.moe", 0)] = TopkCall(scores.double(), scores.topk(k, dim=-1).indices.sort(-1).values)
    return rec


def test_near_tie_is_left_out_and_clear_flip_is_judged():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh scores each run
    tokens, experts = 6, 8
    ref = torch.rand(tokens, experts, generator=gen, dtype=torch.float64) * 0.5
    ref[:, :3] = torch.tensor([0.9, 0.8, 0.7], dtype=torch.float64)  # experts 0 and 1 chosen, expert 2 next
    ref[2, 2] = 0.8 - 1e-4  # token 2: second and third choice tied within rounding
    noise = 1e-3 * (torch.rand(tokens, experts, generator=gen, dtype=torch.float64) - 0.5)
    base = ref + noise  # the unadapted model's rounding: |error| <= 5e-4
    cand = ref - noise
    cand[2, 1], cand[2, 2] = 0.8 - 2e-4, 0.8  # near tie: token 2 flips expert 1 -> 2
    cand[4, 0], cand[4, 3] = 0.1, 0.95  # clear margin: token 4 drops expert 0 for expert 3
    flips = routing_flips(_recording(ref), _recording(base), _recording(cand), tokens, ratio=2.0)
    assert flips.excused == {1: {2}}
    assert flips.clear == {1: 1}
    assert flips.excluded_from(0) == set() and flips.excluded_from(1) == {2} and flips.excluded_from(None) == {2}
    assert len(flips.notes()) == 2  # one line per block with left-out tokens, one per block with clear flips
    # The same near tie is left out when the candidate shows no flip: its topk may not be the routing it uses.
    quiet = routing_flips(_recording(ref), _recording(base), _recording(ref - noise), tokens, ratio=2.0)
    assert quiet.excused == {1: {2}} and not quiet.clear


def test_clear_margins_leave_nothing_out():
    ref = torch.tensor([[0.9, 0.6, 0.3, 0.1]] * 5, dtype=torch.float64)
    flips = routing_flips(_recording(ref), _recording(ref + 1e-9), _recording(ref - 1e-9), 5, ratio=2.0)
    assert not flips.excused and not flips.clear and not flips.notes()


def test_drop_tokens_handles_both_layouts():
    x = torch.arange(2 * 3 * 4.0).view(2, 3, 4)
    kept = drop_tokens(x, {1, 4}, 6)
    assert kept.shape == (4, 4) and torch.equal(kept, x.reshape(6, 4)[[0, 2, 3, 5]])
    assert torch.equal(drop_tokens(x.reshape(6, 4), {0}, 6), x.reshape(6, 4)[1:])
    assert drop_tokens(x, set(), 6) is x


class TinyRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 6, bias=False)

    def forward(self, x):
        weights, index = torch.softmax(self.gate(x), -1).topk(2, dim=-1)
        return x * weights.sum(-1, keepdim=True) + index.float().mean(-1, keepdim=True)


def test_record_routing_attributes_topk_to_the_component():
    block = nn.ModuleDict({"moe": TinyRouter()})
    x = torch.randn(2, 3, 4)
    with record_routing([(Probe("blocks.0.moe", 0, "moe"), block["moe"])]) as rec:
        block["moe"](x)
    ((key, call),) = rec.calls.items()
    assert key == ("blocks.0.moe", 0) and rec.block_of["blocks.0.moe"] == 0
    assert call.scores.shape == (6, 6) and call.chosen.shape == (6, 2)
    want = torch.softmax(block["moe"].gate(x), -1).reshape(6, 6).topk(2, dim=-1).indices.sort(-1).values
    assert torch.equal(call.chosen, want)


def test_masked_scores_do_not_poison_the_rounding():
    """Group-limited routers mask unchosen groups with -inf before the final top-k."""
    ref = torch.tensor([[0.9, 0.5, 0.5 - 1e-4, float("-inf")], [0.9, 0.6, 0.2, float("-inf")]], dtype=torch.float64)
    base = ref + torch.tensor([[0.0, 3e-4, -3e-4, 0.0]] * 2, dtype=torch.float64)  # rounding 3e-4, finite entries only
    flips = routing_flips(_recording(ref), _recording(base), _recording(ref), 2, ratio=2.0)
    assert flips.excused == {1: {0}} and not flips.clear


def test_candidate_routing_inside_a_kernel_leaves_out_only_near_ties():
    ref = torch.tensor([[0.9, 0.5, 0.5 - 1e-4, 0.1], [0.9, 0.6, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)
    opaque = RoutingRecording()  # the candidate's kernel ran no torch.topk
    flips = routing_flips(_recording(ref), _recording(ref + 5e-4), opaque, 3, ratio=2.0)
    assert flips.excused == {1: {0}} and not flips.clear


def test_a_mostly_undecidable_draw_is_redrawn_and_said(monkeypatch, zoo):
    """Fresh inputs whose routing is mostly undecidable leave too little to judge: align draws again (up to
    three times) and says so; a pinned seed is never redrawn."""
    import importlib

    from adapt.model.intake import resolve_source
    from validators.compare import LayerResult

    align_module = importlib.import_module("validators.align")  # the package exposes the function under this name

    options = align_module.AlignOptions(batch=2, seq_len=8)
    # (undecidable tokens, loss terms that see one) of 16, draw after draw: the second draw has few undecidable
    # tokens, but early in their sequences, so most of the gradients' loss would be left out
    shares = iter([(12, 14), (2, 11), (1, 3)])
    seeds = []

    def fake_full_align(src, dtype, device, limits, transform, opts, seed, compiled):
        seeds.append(seed)
        tokens, terms = next(shares)
        logits = LayerResult("logits", None, None, 1.0, 0.0, 0.0, 1.0, 0.0, True, excluded_tokens=tokens)
        return align_module.AlignmentReport(
            src.text, dtype, device, "float32", False, seed, {}, passed=True, layers=[logits], loss_terms_left_out=terms
        )

    monkeypatch.setattr(align_module, "_full_align", fake_full_align)
    src = resolve_source(str(zoo("llama")))
    report = align_module.align(src, dtype="fp32", options=options)
    assert len(seeds) == 3 and len(set(seeds)) == 3 and report.seed == seeds[-1]
    assert report.layers[-1].excluded_tokens == 1
    assert report.input_redraws == 2
    assert report.passed and report.inconclusive is None

    shares = iter([(12, 12)])
    seeds.clear()
    pinned = align_module.align(src, dtype="fp32", options=align_module.AlignOptions(batch=2, seq_len=8, seed=5))
    assert seeds == [5] and pinned.input_redraws == 0
    # 12 of 16 tokens undecidable and no redraw allowed: too few judged, so the pass is withdrawn
    assert not pinned.passed and pinned.inconclusive is not None and pinned.inconclusive.startswith("75%")


def test_only_errors_at_the_choice_boundary_set_the_rounding():
    """A wide softmax router's top scores carry its largest errors; they must not excuse every token."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    tokens, experts = 5, 8
    ref = 0.2 * torch.rand(tokens, experts, generator=gen, dtype=torch.float64)
    ref[:, :3] = torch.tensor([0.9, 0.5, 0.5 - 1e-3], dtype=torch.float64)  # every token: margin 1e-3 after expert 1
    base = ref + 1e-5 * (torch.rand(tokens, experts, generator=gen, dtype=torch.float64) - 0.5)
    base[3, 0] += 0.05  # token 3's top score rounds badly: far from any choice
    flips = routing_flips(_recording(ref), _recording(base), _recording(base), tokens, ratio=2.0)
    assert flips.excused == {} and not flips.clear
    base[3, 2] += 1e-3  # a boundary score off by 1e-3: rounding 2e-3 covers every token's margin
    flips = routing_flips(_recording(ref), _recording(base), _recording(base), tokens, ratio=2.0)
    assert flips.excused == {1: set(range(tokens))}
