"""The typed variant of each component kind: what recognition measured, and all that providers and patches read.

One frozen dataclass per kind (``VARIANTS``).  Recognition builds them from its probes' results; providers,
the patcher, the benchmark and the runtime read attributes.  A field is ``None`` (or its documented default)
when recognition did not measure it: a component recognised by pattern only (meta tensors, or a probe that
did not match) carries what the pattern showed and nothing more.  An MLP names its projections below
itself; every other module path is an absolute dotted path in the model (``local_path`` resolves it below a
module); parameter names are attributes of the component's own module (or of the router, for an MoE's).

JSON (``ops.json``, the stored operators result, ``KernelPlan.to_dict``) keeps the shape it always had: one
object per variant, one key per field (the rotary application's ``global_name`` is written ``global``),
tuples as lists and the attention's ``rope`` as a nested object.  ``variant_from_dict(kind, data)`` builds
the kind's class back:

- a key an older file lacks takes the field's default, as the readers' ``.get`` defaults did before;
- a key this code does not know raises ``BadInput`` naming it: a file written by another version may
  describe a computation these kernels would not reproduce, so a field is never dropped silently;
- a kind this code does not know keeps its fields as they were (``UnknownVariant``) and round-trips
  unchanged; no provider offers a kernel for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from adapt.core.errors import BadInput

_R = TypeVar("_R", bound="_Record")


@dataclass(frozen=True, kw_only=True)
class _Record:
    """Fields that serialise to a JSON object and back; ``metadata["key"]`` renames a field's key,
    ``metadata["load"]`` rebuilds a nested record."""

    def to_dict(self) -> dict[str, Any]:
        return {_key(f): _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls: type[_R], data: Mapping[str, Any], where: str = "") -> _R:
        by_key = {_key(f): f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(by_key))
        if unknown:
            raise BadInput(
                f"{where or cls.__name__}: fields this version of adapt does not know: {', '.join(unknown)} "
                "(written by another version? rerun the operators stage, e.g. adapt run --force)"
            )
        values = {}
        for key, value in data.items():
            f = by_key[key]
            load = f.metadata.get("load")
            values[f.name] = load(value, f"{where}.{key}") if load and value is not None else _tupled(value)
        return cls(**values)


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _plain(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _tupled(value: Any) -> Any:
    """JSON lists back as tuples: a frozen variant holds no mutable containers."""
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True, kw_only=True)
class Variant(_Record):
    """Base of every kind's variant."""


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RMSNormVariant(Variant):
    """``x * rsqrt(mean(x^2) + eps) * (offset + w)``, confirmed against a float64 reference."""

    width: int | None = None
    """Size of the normalised last dimension."""
    eps: float | None = None
    """Added to the mean square inside the square root."""
    offset: float | None = None
    """Added to the weight before it scales: 0.0, or 1.0 for ``(1 + w)`` norms (Gemma's)."""
    weight: str | None = None
    """Name of the scale parameter on the module; None when it has none."""
    cast: str | None = None
    """Rounding order in a narrow dtype (``operators.kernels.norms.CAST_MODES``): ``round_then_scale``
    (normalise in fp32, round, then scale: Llama's) or ``scale_then_round`` (round once at the end: Gemma's)."""
    cast_evidence: str | None = None
    """How the rounding order was decided (bf16 mismatches per emulation)."""
    already_fused: bool = False
    """The module already calls a fused ATen norm (nothing to gain from another kernel)."""


@dataclass(frozen=True, kw_only=True)
class LayerNormVariant(Variant):
    """``F.layer_norm`` over the last dimension."""

    width: int | None = None
    """Size of the normalised last dimension."""
    eps: float | None = None
    """Added to the variance inside the square root."""
    weight: str | None = None
    """Name of the scale parameter on the module; None when it has none."""
    bias: str | None = None
    """Name of the shift parameter on the module; None when it has none."""
    already_fused: bool = False
    """The module already calls a fused ATen norm."""


@dataclass(frozen=True, kw_only=True)
class ResidualAddNormVariant(Variant):
    """A norm whose input is the sum an ``aten.add`` in an enclosing block's own code produced.

    The norm's fields are those of its ``RMSNormVariant`` or ``LayerNormVariant``; the other kind's stay None.
    """

    norm: str | None = None
    """The norm's kind: ``rms_norm`` or ``layer_norm``."""
    add_in: str | None = None
    """Path of the block whose forward runs the add (``""``: the model itself)."""
    add_after: str | None = None
    """Path of the block's child after whose return the add runs; None when the trace saw no such child."""
    add_index: int | None = None
    """How many adds of the block precede this one after ``add_after`` returns."""
    width: int | None = None
    """Size of the normalised last dimension."""
    eps: float | None = None
    """The norm's epsilon."""
    weight: str | None = None
    """Name of the norm's scale parameter; None when it has none."""
    already_fused: bool = False
    """The norm already calls a fused ATen norm."""
    offset: float | None = None
    """RMSNorm: added to the weight before it scales."""
    cast: str | None = None
    """RMSNorm: rounding order in a narrow dtype (see ``RMSNormVariant.cast``)."""
    cast_evidence: str | None = None
    """RMSNorm: how the rounding order was decided."""
    bias: str | None = None
    """LayerNorm: name of the shift parameter."""


# ---------------------------------------------------------------------------------------------
# MLPs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GatedMLPVariant(Variant):
    """``down(act(gate(x)) * up(x))``, gate and up separate or packed in one projection."""

    width: int | None = None
    """Hidden size the MLP maps from and to."""
    activation: str | None = None
    """Name in ``adapt.model.activations.ACTIVATIONS`` (``silu``, ``gelu``, ``gelu_tanh``, ...)."""
    gate: str | None = None
    """Path of the gate projection below the module (the packed projection when ``packed``)."""
    up: str | None = None
    """Path of the up projection below the module (the packed projection when ``packed``)."""
    down: str | None = None
    """Path of the down projection below the module."""
    packed: bool = False
    """Gate and up are the two halves of one projection's output."""
    gate_first: bool | None = None
    """Packed only: the gate is the first half."""


@dataclass(frozen=True, kw_only=True)
class MLPVariant(Variant):
    """``down(act(up(x)))``."""

    width: int | None = None
    """Hidden size the MLP maps from and to."""
    activation: str | None = None
    """Name in ``adapt.model.activations.ACTIVATIONS``."""
    up: str | None = None
    """Path of the up projection below the module."""
    down: str | None = None
    """Path of the down projection below the module."""


# ---------------------------------------------------------------------------------------------
# Attention and rotary position embedding
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RopeStyle(_Record):
    """How an attention forward rotates q and k, read from its traced ops (or found by the rotation's numbers)."""

    style: str | None = None
    """``half`` (dim i pairs with i + r/2), ``interleaved`` (2i with 2i+1) or ``deinterleaved``."""
    rotary_dim: int | None = None
    """Dims of each head that are rotated."""
    partial: bool = False
    """Fewer dims are rotated than the head has."""
    decoupled: bool = False
    """MLA with a rotary part narrower than the head (DeepSeek's decoupled rope)."""


@dataclass(frozen=True, kw_only=True)
class AttentionVariant(Variant):
    """Heads and visibility of an attention module: what a replacing kernel must compute."""

    core: str | None = None
    """``sdpa`` when the trace calls scaled-dot-product attention, ``eager`` for bmm + softmax."""
    num_heads: int | None = None
    """Query heads."""
    num_kv_heads: int | None = None
    """Key/value heads (fewer than ``num_heads``: grouped-query attention)."""
    head_dim: int | None = None
    """Query/key size per head."""
    v_head_dim: int | None = None
    """Value size per head."""
    layout: str | None = None
    """``mha``, ``gqa`` or ``mqa``."""
    mla: bool = False
    """Multi-head latent attention (low-rank latent projections)."""
    softcap: float | None = None
    """c of ``c * tanh(scores / c)`` before the softmax; None: no soft-capping."""
    sinks: bool = False
    """Learned per-head logits join the scores before the softmax."""
    qk_norm: bool = False
    """q and k pass through their own norms."""
    rope: RopeStyle | None = field(default=None, metadata={"load": RopeStyle.from_dict})
    """The rotary embedding applied inside the forward; None: none seen."""
    latent_projections: tuple[str, ...] | None = None
    """MLA only: paths of the latent up-projections."""
    hook: bool = False
    """The module resolves its core through transformers' attention-function hook (replaceable)."""
    causal: bool | None = None
    """Each query sees no later key (measured through float64 gradients)."""
    window: int | None = None
    """Sliding window: keys a query sees, itself included; None: unlimited."""
    seq_len: int | None = None
    """Sequence length the visibility was measured at."""


@dataclass(frozen=True, kw_only=True)
class RotaryVariant(Variant):
    """A module emitting the (cos, sin) tables of a rotary embedding."""

    table_layout: str | None = None
    """``half`` (``cat(f, f)``) or ``interleaved`` frequencies along the last dim."""
    rotary_dim: int | None = None
    """Last dim of the tables."""
    attention_scaling: float | None = None
    """cos at position 0: the scaling folded into the tables."""


@dataclass(frozen=True, kw_only=True)
class RotaryApplicationVariant(Variant):
    """The module-level function an attention forward calls to rotate (q, k), found by its numbers."""

    function: str | None = None
    """Qualified name: ``<module>.<global_name>``."""
    global_name: str | None = field(default=None, metadata={"key": "global"})
    """Name the forward looks the function up by in its module's globals."""
    calls_per_forward: int | None = None
    """Calls of that function during one forward of the attention module."""
    style: str | None = None
    """Rotation style (see ``RopeStyle.style``)."""
    rotary_dim: int | None = None
    """Dims of each head that are rotated."""
    head_dim: int | None = None
    """Size of each head the function is called on."""


# ---------------------------------------------------------------------------------------------
# Routed mixture of experts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MoEVariant(Variant):
    """A routed MoE block, confirmed against the generic float64 MoE reference (``moe.probe_moe``)."""

    width: int | None = None
    """Hidden size of the block's input and output."""
    num_experts: int | None = None
    """Routed experts."""
    scoring: str | None = None
    """Router scores: ``softmax`` or ``sigmoid``."""
    top_k: int | None = None
    """Experts per token."""
    n_group: int = 1
    """Expert groups of group-limited routing (1: none)."""
    topk_group: int = 1
    """Groups each token may choose from."""
    group_score: str | None = None
    """How a group is scored: ``max`` or ``top2_sum`` (its two best experts)."""
    selection_bias: bool | None = None
    """A per-expert bias shifts the choice, not the weights."""
    normalize_topk: bool = True
    """The chosen weights are renormalised to sum to one."""
    routed_scale: float = 1.0
    """Factor on the routed experts' sum."""
    activation: str | None = None
    """Experts' GLU activation (``ACTIVATIONS`` name)."""
    shared_experts: str | None = None
    """Path of the shared-expert MLP added to the routed output; None: none."""
    output_bias: str | None = None
    """Name of the module's own ``[width]`` parameter added to its output; None: none."""
    router: str | None = None
    """Path of the module holding the router's weight."""
    expert_width: int | None = None
    """Inner size of each expert."""
    router_weight: str | None = None
    """Name of the router's weight on ``router``."""
    router_bias: str | None = None
    """Name of the router logits' bias on ``router``; None: none."""
    correction_bias: str | None = None
    """Name of the selection bias buffer on ``router``; None: none."""
    gate_first: bool | None = None
    """The gate is the first half of the gate/up bank's output."""
    outputs: str | None = None
    """What the block returns: ``hidden``, ``hidden+router_logits`` or ``other``."""
    router_logits_output: int | None = None
    """Position of the logits among the router module's outputs; None: read through its weight."""
    stochastic_in_training: bool | None = None
    """Two training-mode calls differ (router jitter, dropout): only the eval function was confirmed."""
    gate_up_bank: str | None = None
    """Dotted path of the [experts, ...] gate/up weight bank (``<list>.*.gate_up`` for a list of experts)."""
    gate_up_layout: str | None = None
    """``out_in`` ([E, out, in]) or ``in_out``; ``module_list`` for experts kept as separate modules."""
    down_bank: str | None = None
    """Dotted path of the down weight bank."""
    down_layout: str | None = None
    """Layout of the down bank, as ``gate_up_layout``."""
    expert_container: str | None = None
    """``bank`` (3-D weight tensors) or ``module_list`` (one module per expert)."""
    experts: str | None = None
    """Path of the expert list when ``module_list``; None for banks."""


# ---------------------------------------------------------------------------------------------
# Everything else
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HeadLossVariant(Variant):
    """A projection onto the vocabulary feeding the causal-LM cross-entropy."""

    vocab: int | None = None
    """Vocabulary size (the projection's output features)."""
    hidden: int | None = None
    """Hidden size (its input features)."""
    final_softcap: float | None = None
    """c of ``c * tanh(logits / c)`` on the logits; None: none."""


@dataclass(frozen=True, kw_only=True)
class EmbeddingVariant(Variant):
    """A module running ``aten.embedding``."""

    extra_ops: tuple[str, ...] = ()
    """Its other computing ATen ops (a scale, a position add)."""


@dataclass(frozen=True, kw_only=True)
class ActivationVariant(Variant):
    """A parameterless module running one elementwise activation."""

    op: str | None = None
    """The ATen overload it runs."""


@dataclass(frozen=True, kw_only=True)
class NewVariant(Variant):
    """A module that computes but matches no kind: it runs as traced, decomposed or as a generated kernel."""

    ops: tuple[str, ...] = ()
    """Its computing ATen ops."""
    container: bool = False
    """It has children and its own code computes between them (it runs as traced)."""
    python_sizes: bool = False
    """Its forward takes Python integers (per-expert token counts, lengths): a compiled graph is specialised to
    their values, so Inductor would compile again whenever they change; it runs as traced."""


@dataclass(frozen=True)
class UnknownVariant(Variant):
    """The variant of a kind this version does not know (a file from another version), kept as it was."""

    raw: Mapping[str, Any] = field(default_factory=dict)
    """The variant's keys and values, unchanged."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)


# Kinds built on ``Variant`` above, kept in a module of their own: the split halves and the vocabulary projection.
from operators.recognition.projection_variants import (
    ProjectionActivationVariant,
    ProjectionResidualNormVariant,
    VocabProjectionVariant,
)

VARIANTS: dict[str, type[Variant]] = {
    "rms_norm": RMSNormVariant,
    "layer_norm": LayerNormVariant,
    "residual_add_norm": ResidualAddNormVariant,
    "gated_mlp": GatedMLPVariant,
    "mlp": MLPVariant,
    "projection_activation": ProjectionActivationVariant,
    "projection_residual_norm": ProjectionResidualNormVariant,
    "attention": AttentionVariant,
    "rotary": RotaryVariant,
    "rotary_application": RotaryApplicationVariant,
    "moe": MoEVariant,
    "lm_head_cross_entropy": HeadLossVariant,
    "vocab_projection": VocabProjectionVariant,
    "embedding": EmbeddingVariant,
    "activation": ActivationVariant,
    "new": NewVariant,
}


def variant_class(kind: str) -> type[Variant]:
    """The variant class of ``kind``; ``UnknownVariant`` for a kind this version does not know."""
    return VARIANTS.get(kind, UnknownVariant)


def variant_from_dict(kind: str, data: Mapping[str, Any] | None, module: str = "") -> Variant:
    """``kind``'s variant (of the component at ``module``, named in errors) from its JSON object; see the
    module docstring for missing and unknown keys."""
    cls = variant_class(kind)
    if cls is UnknownVariant:
        return UnknownVariant(raw=dict(data or {}))
    return cls.from_dict(data or {}, f"{module} ({kind} variant)" if module else f"{kind} variant")


def check_variant(kind: str, variant: Variant, module: str) -> None:
    """A component's variant must be its kind's class: a plain dict or another kind's variant is a bug."""
    cls = variant_class(kind)
    if type(variant) is not cls:
        raise TypeError(f"{module}: a {kind} component needs a {cls.__name__}, not {type(variant).__name__}")
