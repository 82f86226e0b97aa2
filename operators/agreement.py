"""Do intake and the operators stage describe the same model?

Intake reads the module tree and a meta run (``ModelSpec``); the operators stage traces the real model and
recognises components by their numbers (``Recognition``).  ``compare_with_spec`` sets the two side by side, block
by block: the token mixer (attention or not, full or sliding, its window, layout, causality and soft-cap), rotary
embedding, the MLP (kind, activation, MoE routing) and the block's norms, then the output head.  A fact one side
did not examine (a meta model is not probed; a window longer than the probe's sequence cannot be seen; the operators
traced no embedding lookup to compare the head with) is listed as not examined, never as a disagreement.  A disagreement is information for the
user, not a failure: one side described the model wrongly, or the two vocabularies differ where this module does
not yet know it.  Where the vocabularies name one thing differently, the tables below map them: nowhere else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from adapt.core.spec import BlockSpec, ModelSpec
from adapt.model.activations import canonical_activation
from operators.recognition import Recognition
from operators.recognition.component import Component, inside
from operators.recognition.variants import (
    AttentionVariant,
    HeadLossVariant,
    MoEVariant,
    ProjectionResidualNormVariant,
    ResidualAddNormVariant,
    VocabProjectionVariant,
)

Fact = Literal[
    "block",
    "mixer",
    "attention.window",
    "attention.layout",
    "attention.causal",
    "attention.softcap",
    "rope",
    "rope.rotary_dim",
    "mlp.kind",
    "mlp.activation",
    "moe.num_experts",
    "moe.top_k",
    "moe.scoring",
    "moe.shared_experts",
    "moe.n_group",
    "moe.topk_group",
    "norm.kind",
    "norm.eps",
    "norm.offset",
    "head.softcap",
    "head.tied",
]
Side = Literal["intake", "operators"]
Value = str | int | float | bool | None

# ---- the two vocabularies: operators' words in the spec's, and what each side's "none of these" is ----------------

ATTENTION_MIXERS = ("full_attention", "sliding_attention")
ATTENTION = "attention"  # the operators' mixer where the visibility was not measured, or the window lies beyond it
NO_ATTENTION = "no attention"  # the operators' mixer where no attention kind matched the block's code
NORM_KINDS = {"rms_norm": "rmsnorm", "layer_norm": "layernorm"}  # the operators' norm kinds in the spec's words
MLP_KINDS = {
    "gated_mlp": "dense_gated",
    "mlp": "dense_plain",
    "projection_activation": "dense_plain",
    "moe": "moe",
    "routed_experts": "moe",  # the experts of a block whose routing is its own
}
DENSE = "dense"  # the operators' MLP kind recognised by pattern only: gated or not was not measured
NONE = "none"  # no MLP, no norm, no rotary embedding: the same word on both sides
# An operators' word that stands for several of the spec's: the operators know no kind for the other token mixers,
# and a position scheme other than rope rotates nothing.
COVERS: dict[tuple[str, str], frozenset[str]] = {
    ("mixer", ATTENTION): frozenset(ATTENTION_MIXERS),
    ("mlp.kind", DENSE): frozenset({"dense_gated", "dense_plain"}),
    ("mixer", NO_ATTENTION): frozenset({"linear_attention", "ssm", "convolution", "recurrent", "none", "unknown"}),
    ("rope", NONE): frozenset({"none", "absolute", "alibi"}),
}
FLOAT_RTOL = 1e-4  # eps and soft-caps: one side may hold the float32 rounding of the other's value

# why a side did not examine a fact
NOT_PROBED = "not measured: recognised by pattern only"
BEYOND_PROBE = "window not shorter than the sequence the visibility probe ran"
NOT_STATED = "this side does not state it"
NOT_TRACED = "not traced: a meta model is traced one block of each structure"
NO_LOOKUP = "no embedding lookup traced to compare the head's matrix with"
OLD_SPEC = "the spec was written before intake described it"


@dataclass(frozen=True)
class Disagreement:
    """One fact both sides stated differently, at ``module`` (a block, or the component the operators found)."""

    field: Fact
    intake: Value
    operators: Value
    module: str


@dataclass(frozen=True)
class NotExamined:
    """A fact ``side`` did not examine at ``modules``, and why: neither agreement nor disagreement."""

    field: Fact
    side: Side
    reason: str
    modules: tuple[str, ...]


@dataclass
class Agreement:
    """The comparison: how many facts of each kind both sides stated, those they state differently, and what one
    side left open."""

    compared: dict[str, int] = field(default_factory=dict)  # fact -> times both sides stated it
    disagreements: list[Disagreement] = field(default_factory=list)
    not_examined: list[NotExamined] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Facts compared, all kinds together."""
        return sum(self.compared.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "compared": dict(self.compared),
            "total": self.total,
            "disagreements": [dataclasses.asdict(d) for d in self.disagreements],
            "not_examined": [{**dataclasses.asdict(n), "modules": list(n.modules)} for n in self.not_examined],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Agreement:
        return cls(
            compared={k: int(v) for k, v in (data.get("compared") or {}).items()},
            disagreements=[Disagreement(**d) for d in data.get("disagreements", [])],
            not_examined=[NotExamined(**{**n, "modules": tuple(n["modules"])}) for n in data.get("not_examined", [])],
        )


class _Tally:
    """Collects the comparison as it is made."""

    def __init__(self) -> None:
        self.compared: dict[str, int] = {}
        self.disagreements: list[Disagreement] = []
        self.open: dict[tuple[Fact, Side, str], list[str]] = {}

    def compare(self, fact: Fact, intake: Value, operators: Value, module: str) -> None:
        """Both sides stated ``fact``; a None from the operators' variant means not measured, so callers pass only
        stated values (None here is a stated "none", e.g. no soft-cap)."""
        self.compared[fact] = self.compared.get(fact, 0) + 1
        if not _same(fact, intake, operators):
            self.disagreements.append(Disagreement(fact, intake, operators, module))

    def unexamined(self, fact: Fact, side: Side, reason: str, module: str) -> None:
        self.open.setdefault((fact, side, reason), []).append(module)

    def measured(self, fact: Fact, intake: Value, operators: Value, module: str) -> None:
        """Compare where the operators measured ``fact`` (a variant field that is not None)."""
        if operators is None:
            self.unexamined(fact, "operators", NOT_PROBED, module)
        else:
            self.compare(fact, intake, operators, module)

    def result(self) -> Agreement:
        not_examined = [NotExamined(f, s, r, tuple(dict.fromkeys(m))) for (f, s, r), m in self.open.items()]
        return Agreement(self.compared, self.disagreements, not_examined)


def _same(fact: Fact, a: Value, b: Value) -> bool:
    if isinstance(b, str) and a in COVERS.get((fact, b), ()):
        return True
    if isinstance(a, float) or isinstance(b, float):
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
        return numbers and math.isclose(float(a), float(b), rel_tol=FLOAT_RTOL)  # type: ignore[arg-type]
    return a == b


def compare_with_spec(spec: ModelSpec, recognition: Recognition, traced: Collection[str] = ()) -> Agreement:
    """Intake's description of every block and of the head against the components the operators recognised;
    ``traced``: the blocks the operators traced when not all (``OpInventory.traced_blocks``)."""
    tally = _Tally()
    for block in spec.blocks:
        if traced and block.module not in traced:
            tally.unexamined("block", "operators", NOT_TRACED, block.module)
            continue
        inner = [c for c in recognition.components if c.module.startswith(block.module + ".")]
        attention = [c for c in inner if isinstance(c.variant, AttentionVariant)]
        _compare_mixer(tally, block, attention)
        if attention and block.attention is not None:
            for comp in attention:
                _compare_attention(tally, spec, block, comp)
        # what sits inside an attention or an MoE belongs to it (q/k norms, latent norms, shared experts)
        # a routing pattern the probe did not confirm says less than experts inside it that it did: it is set aside
        experts_found = {c.module for c in inner if c.kind == "routed_experts" and c.confirmed}
        superseded = {
            c.module
            for c in inner
            if c.kind == "moe" and not c.confirmed and any(e.startswith(c.module + ".") for e in experts_found)
        }
        enclosing = {c.module for c in inner if c.kind in ("attention", "moe") and c.module not in superseded}
        own = [c for c in inner if not inside(c.module, enclosing, strict=True) and c.module not in superseded]
        _compare_mlp(tally, block, own)
        _compare_norms(tally, spec, block, own)
    _compare_head(tally, spec, recognition.components)
    return tally.result()


def _compare_mixer(tally: _Tally, block: BlockSpec, attention: list[Component]) -> None:
    """Attention or not, then full or sliding and the window."""
    if not attention:
        tally.compare("mixer", block.mixer, NO_ATTENTION, block.module)
    window = block.attention.window if block.attention else None
    for comp in attention:
        variant = comp.variant
        assert isinstance(variant, AttentionVariant)
        if variant.seq_len is None:
            tally.compare("mixer", block.mixer, ATTENTION, comp.module)
            tally.unexamined("attention.window", "operators", NOT_PROBED, comp.module)
        elif window and window >= variant.seq_len and not variant.window:
            tally.compare("mixer", block.mixer, ATTENTION, comp.module)
            tally.unexamined("attention.window", "operators", BEYOND_PROBE, comp.module)
        else:
            tally.compare(
                "mixer", block.mixer, "sliding_attention" if variant.window else "full_attention", comp.module
            )
            if window and variant.window:
                tally.compare("attention.window", window, variant.window, comp.module)


def _compare_attention(tally: _Tally, spec: ModelSpec, block: BlockSpec, comp: Component) -> None:
    """Layout, causality, soft-cap and rotary embedding of one attention the operators found in the block."""
    spec_attention, variant = block.attention, comp.variant
    assert spec_attention is not None and isinstance(variant, AttentionVariant)
    layout = "mla" if variant.mla else variant.layout
    tally.measured("attention.layout", spec_attention.kind, layout, comp.module)
    tally.measured("attention.causal", spec_attention.causal, variant.causal, comp.module)
    tally.compare("attention.softcap", spec_attention.softcap, variant.softcap, comp.module)  # read off the trace
    tally.compare("rope", block.positional, "rope" if variant.rope is not None else NONE, comp.module)
    if block.positional == "rope" and variant.rope is not None:
        if spec.rope is None:  # a rotation measured, but no rotary table to read its size from
            tally.unexamined("rope.rotary_dim", "intake", NOT_STATED, comp.module)
        else:
            tally.measured("rope.rotary_dim", spec.rope.get("rotary_dim"), variant.rope.rotary_dim, comp.module)


def _compare_mlp(tally: _Tally, block: BlockSpec, own: list[Component]) -> None:
    """The block's MLP: dense (gated or not) or a routed MoE, its activation and its routing.  Where several MLPs sit
    in the block, the outermost is its feed-forward: one nested deeper belongs to another part (AXK2's gated norm
    holds a small gate MLP)."""
    mlps = [c for c in own if c.kind in MLP_KINDS]
    moe = next((c for c in mlps if isinstance(c.variant, MoEVariant)), None)
    experts = next((c for c in mlps if c.kind == "routed_experts"), None)  # the block's routing is its own code
    outermost = min((c.module.count(".") for c in mlps), default=0)
    routed = moe or experts
    judged = [routed] if routed is not None else [c for c in mlps if c.module.count(".") == outermost]
    found = NONE
    if judged:
        found = DENSE if judged[0].kind == "mlp" and not judged[0].confirmed else MLP_KINDS[judged[0].kind]
    tally.compare("mlp.kind", block.mlp.kind, found, judged[0].module if judged else block.module)
    if not _same("mlp.kind", block.mlp.kind, found) or found == NONE:
        return
    spec_activation = canonical_activation(block.mlp.activation)
    for comp in judged:
        activation = getattr(comp.variant, "activation", None)
        measured = canonical_activation(activation) if activation else None
        tally.measured("mlp.activation", spec_activation, measured, comp.module)
    if moe is not None:
        _compare_routing(tally, block, moe)
    elif experts is not None:  # routing left to the model's own code: the experts alone are compared
        tally.measured("moe.num_experts", block.mlp.num_experts, experts.variant.num_experts, experts.module)
        tally.measured("moe.top_k", block.mlp.top_k, experts.variant.top_k, experts.module)


def _compare_routing(tally: _Tally, block: BlockSpec, moe: Component) -> None:
    mlp, variant = block.mlp, moe.variant
    assert isinstance(variant, MoEVariant)
    tally.measured("moe.num_experts", mlp.num_experts, variant.num_experts, moe.module)
    tally.measured("moe.top_k", mlp.top_k, variant.top_k, moe.module)
    tally.measured("moe.scoring", mlp.router_scoring, variant.scoring, moe.module)
    # fields with a default hold a measurement only once the probe confirmed the block
    confirmed = moe.confirmed
    shared = variant.shared_experts is not None if confirmed else None
    tally.measured("moe.shared_experts", mlp.num_shared_experts > 0, shared, moe.module)
    tally.measured("moe.n_group", mlp.n_group, variant.n_group if confirmed else None, moe.module)
    tally.measured("moe.topk_group", mlp.topk_group, variant.topk_group if confirmed else None, moe.module)


def _compare_norms(tally: _Tally, spec: ModelSpec, block: BlockSpec, own: list[Component]) -> None:
    """Every norm over the residual width in the block against the one norm the spec states for it."""
    norms = list(_block_norms(own, spec.hidden_size))
    if not norms:
        tally.compare("norm.kind", block.norm.kind, NONE, block.module)
    for module, kind, eps, offset in norms:
        tally.compare("norm.kind", block.norm.kind, NORM_KINDS.get(kind, kind), module)
        if NORM_KINDS.get(kind) != block.norm.kind:
            continue
        tally.measured("norm.eps", block.norm.eps, eps, module)
        if kind == "rms_norm":
            tally.measured("norm.offset", block.norm.offset, offset, module)


def _block_norms(own: list[Component], hidden: int) -> Iterable[tuple[str, str, float | None, float | None]]:
    """(module, kind, eps, offset) of each norm over ``hidden`` (or of unmeasured width): a norm module once,
    however many components name it (its residual add, the projection it follows)."""
    plain = {c.module for c in own if c.kind in NORM_KINDS}
    for comp in own:
        variant = comp.variant
        kind: str | None = None
        if comp.kind in NORM_KINDS:
            kind = comp.kind
        elif isinstance(variant, ResidualAddNormVariant) and comp.module not in plain:
            kind = variant.norm
        elif isinstance(variant, ProjectionResidualNormVariant) and variant.norm_module is None:
            kind = variant.norm  # inline; None: the half adds without a norm, or the pattern did not say
        if kind is None:
            continue
        width = getattr(variant, "width", None)
        if width is None or width == hidden:
            yield comp.module, kind, getattr(variant, "eps", None), getattr(variant, "offset", None)


def _compare_head(tally: _Tally, spec: ModelSpec, components: list[Component]) -> None:
    """The output head's soft-cap (read off the loss's trace) and whether it shares the token table's matrix."""
    head = next((c for c in components if isinstance(c.variant, HeadLossVariant)), None)
    projection = head or next((c for c in components if isinstance(c.variant, VocabProjectionVariant)), None)
    module = projection.module if projection is not None else "<output head>"
    if spec.head is None:
        tally.unexamined("head.softcap", "intake", OLD_SPEC, module)
        return
    if head is None:
        tally.unexamined("head.softcap", "operators", "no output head with a loss was recognised", module)
    else:
        tally.compare("head.softcap", spec.head.softcap, head.variant.final_softcap, module)  # type: ignore[union-attr]
    if projection is None:
        tally.unexamined("head.tied", "operators", "no projection onto the vocabulary was recognised", module)
    elif projection.variant.tied is None:  # type: ignore[union-attr]
        tally.unexamined("head.tied", "operators", NO_LOOKUP, module)
    else:
        tally.compare("head.tied", spec.head.tied, projection.variant.tied, module)  # type: ignore[union-attr]
