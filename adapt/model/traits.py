"""What a spec says about itself in words: the traits it found (features) and what adapt does not know (novelties).

Read off the described blocks by ``adapt.model.intake``; kept here so that the reading of the module tree and the
wording of its result change apart.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from adapt.core.spec import BlockSpec, HeadSpec
from adapt.model.blocks import BlockList, stacks_beside


def novelties(blocks: list[BlockSpec], unrecognized: list[str]) -> list[str]:
    """What is new relative to the kinds adapt knows: token mixers it cannot name, components it cannot identify."""
    n = len(blocks)
    mixers = Counter(b.mixer for b in blocks if b.mixer in ("unknown", "convolution", "recurrent"))
    notes = [
        f"{'unidentified' if m == 'unknown' else m} token mixer in {count}/{n} blocks" for m, count in mixers.items()
    ]
    notes += [f"{m} token mixer besides attention in {count}/{n} blocks" for m, count in _second_mixers(blocks).items()]
    return notes + [f"unrecognised component: {u}" for u in unrecognized]


def _second_mixers(blocks: list[BlockSpec]) -> Counter:
    """Blocks that mix tokens twice, by the kind of their mixer besides attention (its state is per sequence, not
    per token: the KV cache figure leaves it out)."""
    return Counter(b.second_mixer for b in blocks if b.second_mixer)


def stacks_left_out(model: nn.Module, described: BlockList, total: int) -> list[str]:
    """Stacks beside the described one are said, not guessed at: which of them the tokens pass through, and at what
    rate (a byte-level model's global stack runs once per patch), the module tree does not tell."""
    beside = sorted(stacks_beside(model, described), key=lambda stack: -stack[1])  # the largest first
    if not beside:
        return []
    listed = "; ".join(f"{s.path} ({len(s)} blocks, {n / total:.0%} of the parameters)" for s, n in beside[:4])
    more = f" and {len(beside) - 4} more" if len(beside) > 4 else ""
    return [
        f"{len(beside)} other repeated stack(s) beside {described.path}, not in this spec's blocks, FLOPs or KV cache "
        f"(their parameters count as other): {listed}{more}"
    ]


def features(blocks: list[BlockSpec], is_causal: bool, head: HeadSpec) -> list[str]:
    """Every known trait, stated: mixers per block, attention layout and treatment, MoE routing, norms, head."""
    notes: list[str] = []
    n = len(blocks)
    for mixer, count in Counter(b.mixer for b in blocks).items():
        notes.append(f"{mixer.replace('_', ' ')} in {count}/{n} blocks")
    for mixer, count in _second_mixers(blocks).items():
        notes.append(f"{mixer} mixer besides attention in {count}/{n} blocks")
    attn = [b.attention for b in blocks if b.attention]
    for kind, count in Counter(a.kind for a in attn).items():
        notes.append(f"{kind.upper()} attention in {count}/{n} blocks")
    windows = [a.window for a in attn if a.window]
    if windows:
        notes.append(f"sliding-window attention (window {windows[0]}) in {len(windows)}/{n} blocks")
    if any(a.softcap for a in attn):
        notes.append(f"attention logit soft-capping at {next(a.softcap for a in attn if a.softcap)}")
    if any(a.sinks for a in attn):
        notes.append("learned attention sinks")
    if any(a.qk_norm for a in attn):
        notes.append("QK normalisation")
    shared = sum(a.kv_shared for a in attn)
    if shared:
        notes.append(
            f"cross-layer KV sharing: {shared}/{n} blocks attend to another layer's K/V (no cache of their own)"
        )
    moe = [b.mlp for b in blocks if b.mlp.kind == "moe"]
    if moe:
        m = moe[0]
        shared = f", {m.num_shared_experts} shared" if m.num_shared_experts else ""
        groups = f", grouped routing {m.topk_group}/{m.n_group}" if m.n_group > 1 else ""
        notes.append(
            f"MoE in {len(moe)}/{n} blocks: {m.num_experts} experts, top-{m.top_k} {m.router_scoring}{shared}{groups}"
        )
    if any(b.norm.offset for b in blocks):
        notes.append("(1 + w) offset norm scaling")
    for placement in Counter(b.norm.placement for b in blocks):
        if placement not in ("pre", "unknown"):
            notes.append(f"{placement}-norm blocks")
    if head.softcap:
        notes.append(f"final logit soft-capping at {head.softcap}")
    if head.tied:
        notes.append("output head tied to the token embedding")
    if not is_causal:
        notes.append("bidirectional (encoder) attention")
    return notes
