"""Variants of the remaining kinds: the routed MoE block, the vocabulary head with its loss, embeddings, lone
activations, and modules that compute but match no kind."""

from __future__ import annotations

from dataclasses import dataclass

from operators.recognition.variants.base import Variant

# ---------------------------------------------------------------------------------------------
# Routed mixture of experts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RoutedExpertsVariant(Variant):
    """Expert banks called with the routing their block computed: ``experts(hidden [T, H], index [T, k], weights
    [T, k])`` returns ``sum_k weights * down_e(act(gate_e(x)) * up_e(x))``, whatever chose ``index`` and ``weights``
    (``moe.probe_routed_experts``).  Where the block's own routing is recognised the whole block is a ``moe``."""

    width: int | None = None
    """Hidden size of the tokens in and out."""
    num_experts: int | None = None
    """Experts in the banks."""
    top_k: int | None = None
    """Experts per token, as traced."""
    activation: str | None = None
    """Experts' GLU activation (``ACTIVATIONS`` name)."""
    expert_width: int | None = None
    """Inner size of each expert."""
    gate_first: bool | None = None
    """The gate is the first half of the gate/up bank's output."""
    limit: float | None = None
    """The unit's inputs clamped first: the gate to at most it, the linear half to within plus or minus it
    (DeepSeek-V4's SwiGLU limit); None: no clamp."""
    gate_up_bank: str | None = None
    """Dotted path of the [experts, ...] gate/up bank; the gate bank alone when ``up_bank`` is set."""
    up_bank: str | None = None
    """Dotted path of the up bank where gate and up are kept apart; None: fused with the gate."""
    gate_up_layout: str | None = None
    """``out_in`` ([E, out, in]) or ``in_out``."""
    down_bank: str | None = None
    """Dotted path of the down bank."""
    down_layout: str | None = None
    """Layout of the down bank, as ``gate_up_layout``."""


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
    """Dotted path of the [experts, ...] gate/up weight bank (``<list>.*.gate_up`` for a list of experts); the gate
    bank alone when ``up_bank`` is set."""
    up_bank: str | None = None
    """Dotted path of the up bank where gate and up are kept apart (DBRX's ``v1``); None: fused with the gate."""
    bank_rows: bool = False
    """The banks are 2-D matrices stacking the experts in their rows ([experts x rows, width]), read as 3-D views."""
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
    tied: bool | None = None
    """Its matrix is the table a traced embedding lookup reads (one Parameter, or one storage); None: no lookup was
    traced to compare it with."""


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
