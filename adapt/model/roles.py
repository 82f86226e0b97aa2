"""Which child of a block does what: the attention, the feed-forward, the experts, another token mixer, or a side path.

A block's parameter-holding children (the owners ``structure.split_block`` groups its matrices by) are sorted by the
shapes of their matrices and by what the measurement saw each compute (``measure.ChildFacts``); intake then describes
each role from its children.  This is the one place that answers the question.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adapt.model.measure import ChildFacts
from adapt.model.structure import (
    BlockLeaves,
    Projection,
    heads_kept_as_experts,
    is_mlp_group,
    is_whole_feed_forward,
)


@dataclass
class ChildRoles:
    owners: list[str]  # every child holding a matrix ("" for matrices on the block itself)
    attention: list[str]
    mlp: list[str]
    moe: list[str]  # children holding expert banks
    mixer: list[str]  # a recurrent or convolution token mixer
    side: list[str]  # per-token projections that are none of the above (counted as FLOPs, their parameters as other)
    expert_attention: list[str]  # an attention that keeps its query heads as experts (in ``attention`` too)

    @property
    def feed_forward_only(self) -> bool:
        """A layer holding a feed-forward and nothing else that mixes tokens (Nemotron-H's MLP and expert layers)."""
        return bool(self.mlp or self.moe) and set(self.owners) <= set(self.mlp) | set(self.moe)


def split_nested_blocks(parts: BlockLeaves, facts: dict[str, ChildFacts], hidden: int) -> dict[str, ChildFacts]:
    """A child that is itself a whole transformer block (the shared attention-and-MLP layer inside Zamba's hybrid
    layers): its attention and its feed-forward become owners of their own, ``child.grandchild`` (in place).  Told
    from what it computes and holds: it ran an attention core, and its matrices sit in several grandchildren, one of
    them a whole feed-forward.  Returns the facts with each new owner sharing its child's."""
    facts = dict(facts)
    for owner in [o for o in parts.projections if o and o in facts and facts[o].head_dim]:
        groups: dict[str, list[Projection]] = {}
        for proj in parts.projections[owner]:
            pieces = proj.path.split(".")
            groups.setdefault(pieces[1] if len(pieces) > 2 else "", []).append(proj)
        mlp = [
            g
            for g, ps in groups.items()
            if len(ps) <= 3 and is_mlp_group(ps, hidden) and is_whole_feed_forward(ps, hidden)
        ]
        if "" in groups or len(groups) < 2 or len(mlp) != 1:
            continue
        del parts.projections[owner]
        for group, projs in groups.items():
            parts.projections[f"{owner}.{group}"] = projs
            facts[f"{owner}.{group}"] = facts[owner]
    return facts


def settle_banks(parts: BlockLeaves, facts: dict[str, ChildFacts], hidden: int) -> None:
    """Which matrices are expert banks, from what the block was seen to compute (in place).

    Shapes alone guess: a 3-D parameter is a bank, several same-shaped matrices on one module are not.  Where a child
    holding 3-D parameters was seen convolving over the positions or running an attention core, and nothing in the
    block chose among experts with a top-k, they are per-head matrices of that token mixer (Zamba's Mamba, Recurrent
    Gemma's RG-LRU beside its convolution, XLNet's attention), kept as projections.  Exponentials alone say nothing:
    routers without a top-k (PhiMoE's sparse mixer, hashed routing) run them too.  Where the block's router chose among
    ``E`` and same-shaped matrices stack ``E`` experts in their rows, they are banks.
    """
    routers = [f for f in facts.values() if f.top_k]
    if not routers:
        _mixer_matrices_out_of_banks(parts, facts, hidden)
        return
    experts = next((f.choices for f in routers if f.choices), None)
    if experts is not None and experts >= 2:
        _stacked_rows_into_banks(parts, experts)


def _mixer_matrices_out_of_banks(parts: BlockLeaves, facts: dict[str, ChildFacts], hidden: int) -> None:
    """Nothing routes: banks held by a child seen convolving or running an attention core are that mixer's."""
    for owner in list(parts.banks):
        kept = []
        for path, shape in parts.banks.pop(owner):
            holder = _holder(path, facts)  # the child (or a nested block's part) that holds it, as measured
            child = facts.get(holder)
            if child is None or not (child.convolution or child.head_dim):
                kept.append((path, shape))
            elif hidden in shape and parts.bank_layout.get(owner) != "list":
                size = math.prod(shape)
                parts.projections.setdefault(holder, []).append(Projection(path, (hidden, size // hidden), False, size))
            else:  # a list of small modules beside a mixer (Zamba2's per-layer adapters): parameters, no matrix of it
                module, _, name = path.rpartition(".")
                parts.other_1d.append((module, name, math.prod(shape)))
        if kept:
            parts.banks[owner] = kept


def _stacked_rows_into_banks(parts: BlockLeaves, experts: int) -> None:
    """The router chose among ``experts``: same-shaped matrices whose rows stack that many experts are banks."""
    for owner, matrices in parts.stacked.items():
        if owner in parts.banks or not all(rows % experts == 0 and rows > experts for _, (rows, _) in matrices):
            continue
        paths = {path for path, _ in matrices}
        parts.other_1d = [entry for entry in parts.other_1d if f"{entry[0]}.{entry[1]}" not in paths]
        parts.banks[owner] = [(path, (experts, rows // experts, cols)) for path, (rows, cols) in matrices]
        parts.bank_layout[owner] = "rows"


def _holder(path: str, facts: dict[str, ChildFacts]) -> str:
    """The longest measured owner a parameter path lies under (a nested block's part before its child)."""
    under = [key for key in facts if key and (path == key or path.startswith(key + "."))]
    return max(under, key=len, default=path.split(".", 1)[0])


def child_roles(parts: BlockLeaves, facts: dict[str, ChildFacts], hidden: int) -> ChildRoles:
    owners = list(parts.projections)
    moe_owners = [o for o in parts.banks if any(parts.banks[o])]
    mlp_owners = [o for o in owners if o not in moe_owners and len(parts.projections[o]) <= 3
                  and is_mlp_group(parts.projections[o], hidden)]  # fmt: skip
    # Beside a named child that is a whole feed-forward (its own up and down projections), projections sitting on the
    # block itself or halves in other children are a side path (Gemma 3n/4's per-layer input gate and projection), not
    # part of it; without one, halves in separate children are the feed-forward (BERT's intermediate and output).
    # Several whole ones: the largest is the feed-forward, the others side paths (Gemma 3n's low-rank LAUReL block).
    whole = [o for o in mlp_owners if o and is_whole_feed_forward(parts.projections[o], hidden)]
    main = max(whole, key=lambda o: sum(p.params for p in parts.projections[o]), default=None)
    side_owners = [o for o in mlp_owners if o != main and (o in whole or o == "")] if main else []
    mlp_owners = [o for o in mlp_owners if o not in side_owners]
    # A child seen convolving or carrying a decaying state, and never running an attention core, mixes tokens
    # by convolution or recurrence, whatever its projections look like.
    mixer_owners = [o for o, f in facts.items() if (not f.head_dim or f.kv_state) and (f.convolution or f.recurrence or o in parts.convolutions)
                    and o not in mlp_owners and o not in moe_owners]  # fmt: skip
    mixer_owners += [o for o in parts.convolutions if o not in facts and o not in mixer_owners]
    # An attention reads or writes the residual width; a child whose projections never touch it (hyper-connection
    # mixing over several residual streams) is no attention and its parameters count as "other".
    attn_owners = [o for o in owners if o not in moe_owners and o not in mlp_owners and o not in mixer_owners
                   and o not in side_owners and any(hidden in p.shape for p in parts.projections[o])]  # fmt: skip
    # Where the attention core was seen running, the children it did not run in are no part of the attention (Gemma
    # 3n's AltUp predictor and router beside it), whatever widths their matrices touch.
    cores = [o for o in attn_owners if o in facts and facts[o].head_dim]
    if cores:
        side_owners += [o for o in attn_owners if o not in cores]
        attn_owners = cores
    # No attention among the plain children: a child holding expert banks may keep its query heads as the experts.
    expert_attention = [] if attn_owners else [
        o for o in moe_owners if heads_kept_as_experts(parts.projections.get(o, []), parts.banks[o], hidden)][:1]  # fmt: skip
    moe_owners = [o for o in moe_owners if o not in expert_attention]
    attn_owners += expert_attention
    return ChildRoles(owners, attn_owners, mlp_owners, moe_owners, mixer_owners, side_owners, expert_attention)
