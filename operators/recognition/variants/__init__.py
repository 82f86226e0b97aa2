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

The classes live by kind family (``norms_mlps``, ``attention``, ``projections``, ``other_kinds``) over the serialisation they
share (``base``); every one is importable from here, with the registry and the loaders.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from operators.recognition.variants.attention import (
    AttentionVariant,
    RopeStyle,
    RotaryApplicationVariant,
    RotaryVariant,
)
from operators.recognition.variants.base import Variant
from operators.recognition.variants.norms_mlps import (
    GatedMLPVariant,
    LayerNormVariant,
    MLPVariant,
    ResidualAddNormVariant,
    RMSNormVariant,
)
from operators.recognition.variants.other_kinds import (
    ActivationVariant,
    EmbeddingVariant,
    HeadLossVariant,
    MoEVariant,
    NewVariant,
    RoutedExpertsVariant,
)
from operators.recognition.variants.projections import (
    ProjectionActivationVariant,
    ProjectionResidualNormVariant,
    VocabProjectionVariant,
)

__all__ = [
    "VARIANTS",
    "ActivationVariant",
    "AttentionVariant",
    "EmbeddingVariant",
    "GatedMLPVariant",
    "HeadLossVariant",
    "LayerNormVariant",
    "MLPVariant",
    "MoEVariant",
    "NewVariant",
    "ProjectionActivationVariant",
    "ProjectionResidualNormVariant",
    "VocabProjectionVariant",
    "RMSNormVariant",
    "ResidualAddNormVariant",
    "RoutedExpertsVariant",
    "RopeStyle",
    "RotaryApplicationVariant",
    "RotaryVariant",
    "UnknownVariant",
    "Variant",
    "check_variant",
    "variant_class",
    "variant_from_dict",
]


@dataclass(frozen=True)
class UnknownVariant(Variant):
    """The variant of a kind this version does not know (a file from another version), kept as it was."""

    raw: Mapping[str, Any] = field(default_factory=dict)
    """The variant's keys and values, unchanged."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)


VARIANTS: dict[str, type[Variant]] = {
    "rms_norm": RMSNormVariant,
    "layer_norm": LayerNormVariant,
    "residual_add_norm": ResidualAddNormVariant,
    "gated_mlp": GatedMLPVariant,
    "mlp": MLPVariant,
    "projection_activation": ProjectionActivationVariant,
    "projection_residual_norm": ProjectionResidualNormVariant,
    "vocab_projection": VocabProjectionVariant,
    "attention": AttentionVariant,
    "rotary": RotaryVariant,
    "rotary_application": RotaryApplicationVariant,
    "moe": MoEVariant,
    "routed_experts": RoutedExpertsVariant,
    "lm_head_cross_entropy": HeadLossVariant,
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
