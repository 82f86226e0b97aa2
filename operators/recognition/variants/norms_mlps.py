"""Variants of the normalisation and MLP kinds, the halves of an MLP split across two modules included."""

from __future__ import annotations

from dataclasses import dataclass

from operators.recognition.variants.base import Variant

# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RMSNormVariant(Variant):
    """``x * rsqrt(mean(x^2) + eps) * (offset + w)``, confirmed against a float64 reference."""

    width: int | None = None
    """Size of the normalised last dimension."""
    rows_per_token: int = 1
    """Rows it normalises per token of the model's input (a per-head q/k norm: the heads), so that a candidate is
    timed on as many rows as the model gives it, not on one row per token."""
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
    rows_per_token: int = 1
    """Rows it normalises per token of the model's input (a per-head q/k norm: the heads), so that a candidate is
    timed on as many rows as the model gives it, not on one row per token."""
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
    rows_per_token: int = 1
    """As ``RMSNormVariant.rows_per_token``."""
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
