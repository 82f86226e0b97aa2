"""Variants of attention and of the rotary position embedding: its tables, and the function that applies them."""

from __future__ import annotations

from dataclasses import dataclass, field

from operators.recognition.variants.base import Variant, _Record


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
    table: str = "cos_sin"
    """What the function rotates by: ``cos_sin`` tables ``(q, k, cos, sin)``, or one ``complex`` table
    ``(q, k, freqs)`` multiplying each pair of dims read as a complex number (Llama 4's)."""
    layout: str = "bhsd"
    """Axis order of the q and k it is called with: ``bhsd``, or ``bshd`` (heads after positions)."""
