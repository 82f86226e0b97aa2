"""Variants of the kinds built around one projection: the halves of an MLP or attention output split across sibling
modules (BERT's), with an optional norm, and the vocabulary projection whose loss the trace did not run.

``variants.VARIANTS`` registers them; they live apart from the other kinds' so that this family grows in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from operators.recognition.variants.base import Variant


@dataclass(frozen=True, kw_only=True)
class _NormAfter(Variant):
    """The norm a split half applies last, when it applies one: its fields are those of its ``LayerNormVariant`` or
    ``RMSNormVariant``.  On a confirmed component ``norm`` None means the probe found none; pattern only, that
    the pattern did not measure it."""

    norm: str | None = None
    """The norm's kind: ``layer_norm`` or ``rms_norm``; None when the half does not normalise (see above)."""
    norm_module: str | None = None
    """Path of the norm's own module below the module; None when it normalises inline, or not at all."""
    eps: float | None = None
    """The norm's epsilon."""
    weight: str | None = None
    """Dotted name of the norm's scale parameter below the module; None when it has none."""
    bias: str | None = None
    """LayerNorm: dotted name of its shift parameter below the module; None when it has none."""
    offset: float | None = None
    """RMSNorm: added to the weight before it scales."""


@dataclass(frozen=True, kw_only=True)
class ProjectionActivationVariant(_NormAfter):
    """``act(proj(x))``, or ``norm(act(proj(x)))``, in a module of its own: the up half of an MLP whose down half is a
    sibling module (BERT's intermediate), or a prediction head's transform (BERT's, normalised, no residual),
    confirmed against a float64 reference."""

    width: int | None = None
    """Size of the input: the projection's in features."""
    inner: int | None = None
    """Size of the output: the projection's out features."""
    activation: str | None = None
    """Name in ``adapt.model.activations.ACTIVATIONS``."""
    projection: str | None = None
    """Path of the projection below the module."""


@dataclass(frozen=True, kw_only=True)
class ProjectionResidualNormVariant(_NormAfter):
    """``norm(dropout(proj(branch)) + residual)``, or ``dropout(proj(branch)) + residual`` for a pre-norm layer
    (Megatron-BERT's), in a module called with (branch, residual): the down half of an MLP split across two modules,
    or an attention's output projection written the same way, confirmed against a float64 reference."""

    width: int | None = None
    """Size of the residual stream: the projection's out features and the norm's width."""
    inner: int | None = None
    """The projection's in features."""
    projection: str | None = None
    """Path of the projection below the module."""
    branch_input: int | None = None
    """Position of the projected tensor among the module's tensor inputs (positional first, then keywords)."""
    residual_input: int | None = None
    """Position of the residual among the module's tensor inputs."""
    dropout: float | None = None
    """Probability with which training mode drops the projection's output before the add, confirmed by replaying
    the module's random draws; 0.0: training mode computes the eval function.  None: not measured, or training mode
    is random in a way no probability found on the module reproduced (only the eval function is confirmed)."""


@dataclass(frozen=True, kw_only=True)
class VocabProjectionVariant(Variant):
    """``x @ W.T (+ b)`` onto the vocabulary, yielding the model's output, when the model's loss is not in the trace
    (its labelled call failed): the projection alone, confirmed against a float64 reference; no loss is claimed."""

    vocab: int | None = None
    """Vocabulary size: the projection's out features, the rows of the table the input ids index."""
    hidden: int | None = None
    """Its in features."""
    weight: str | None = None
    """Name of the ``[vocab, hidden]`` matrix on the module."""
    bias: str | None = None
    """Name of the ``[vocab]`` shift on the module; None when it adds none."""
    tied: bool | None = None
    """Its matrix is the table a traced embedding lookup reads (one Parameter, or one storage); None: no lookup was
    traced to compare it with."""
