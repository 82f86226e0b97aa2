"""A recognised routed-MoE block run on adapt's Triton kernels.

router matmul -> ``moe_route`` (scoring, selection bias, grouped top-k, renormalise, scale) ->
``moe_permute`` -> grouped GEMM (gate/up bank) -> SwiGLU/GeGLU -> grouped GEMM (down bank) ->
``moe_unpermute`` (weighted combine) -> + the module's own shared-expert submodule and output bias.
Where the block routes in a way ``moe_route`` does not compute, its expert banks alone run from ``moe_permute`` on
(``experts_forward``), called with the indices and weights the block's own code chose.

Everything is driven by the variant recognition measured against its float64 reference (routing,
activation, gate/up order, bank layouts, tensor names); tensors are looked up on the module by name
on every call, so parameter swaps (FSDP2, TP, ``load_state_dict(assign=True)``) are seen.  When the
router submodule returns its logits it is called for them, so hooks on it keep firing (transformers
records router logits there for the load-balancing loss); its own top-k result is then unused, an
extra ``[tokens, experts]`` of elementwise work.  A variant these kernels cannot compute is refused
up front by ``unsupported_reason`` and the component stays native; the forward never falls back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from operators.recognition.component import Component, dotted_attr, local_path
from operators.recognition.variants import MoEVariant, RoutedExpertsVariant

GLU_KERNELS = {"silu": ("swiglu", None), "gelu": ("geglu", "none"), "gelu_tanh": ("geglu", "tanh")}
SCORINGS = ("softmax", "sigmoid")
OUTPUTS = ("hidden", "hidden+router_logits")
_REQUIRED = (
    "router",
    "router_weight",
    "gate_up_bank",
    "down_bank",
    "gate_up_layout",
    "down_layout",
    "gate_first",
    "outputs",
    "stochastic_in_training",
)


@dataclass(frozen=True)
class RoutedExperts:
    """The routed computation, independent of where the tensors live."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = True
    scale: float = 1.0
    activation: str = "silu"
    gate_first: bool = True
    limit: float | None = None  # the unit's inputs clamped first (gate <= limit, |up| <= limit); None: not


def unsupported_reason(variant: MoEVariant, training: bool = False) -> str | None:
    """Why this recognised variant cannot run on the kernels (None when it can)."""
    missing = [k for k in _REQUIRED if getattr(variant, k) is None]
    if missing:
        return (
            f"variant lacks {', '.join(missing)}: the probe matched none of the routed forms the kernels compute "
            "(or the variant was recorded before these fields)"
        )
    if training and variant.stochastic_in_training:
        return (
            "the module is random in training mode (router jitter, dropout); the kernels compute its eval-mode function"
        )
    if variant.scoring not in SCORINGS:
        return f"router scoring {variant.scoring!r} is not one of {SCORINGS}"
    if variant.activation not in GLU_KERNELS:
        return f"expert activation {variant.activation!r} has no GLU kernel (have {sorted(GLU_KERNELS)})"
    if variant.outputs not in OUTPUTS:
        return f"module returns {variant.outputs!r}; the patched forward reproduces only {OUTPUTS}"
    experts, groups = int(variant.num_experts), int(variant.n_group)
    if groups > 1 and variant.group_score != "top2_sum":
        return f"group score {variant.group_score!r}: moe_route scores a group by its two best experts"
    if groups > 1 and (experts % groups or experts // groups < 2):
        return f"{experts} experts in {groups} groups: moe_route needs equal groups of at least two"
    if {variant.gate_up_layout, variant.down_layout} - {"out_in", "in_out"}:
        return f"unknown bank layout {variant.gate_up_layout!r}/{variant.down_layout!r}"
    return None


def routed_experts(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    spec: RoutedExperts,
    correction_bias: torch.Tensor | None = None,
    w_up: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_k w[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t))`` over each token's chosen experts.

    ``x`` is ``[T, H]``; ``w_gate_up`` is ``[E, H, 2I]`` and ``w_down`` ``[E, I, H]`` (``x @ w[e]``
    orientation; strided views are read in place).  With ``w_up`` (``[E, H, I]``), gate and up are banks apart and
    ``w_gate_up`` is the gate's alone: two grouped GEMMs instead of a copy of both into one.  Returns ``[T, H]`` in the
    banks' dtype.
    """
    from operators import kernels

    weights, expert_ids = kernels.moe_route(
        router_logits,
        spec.top_k,
        spec.scoring,
        spec.n_group,
        spec.topk_group,
        spec.normalize,
        correction_bias,
        spec.scale,
    )
    return chosen_experts(x, weights, expert_ids, w_gate_up, w_down, spec, w_up)


def chosen_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    spec: RoutedExperts,
    w_up: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(x_t)`` for routing already chosen (``[T, k]`` each), on the banks
    as ``routed_experts`` takes them: permute, grouped GEMMs around the fused GLU, weighted unpermute."""
    from operators import kernels

    x_sorted, state = kernels.moe_permute(x.to(w_gate_up.dtype), expert_ids, spec.num_experts)
    if w_up is not None:
        gate = kernels.grouped_gemm(x_sorted, w_gate_up, state.group_offsets)
        up = kernels.grouped_gemm(x_sorted, w_up, state.group_offsets)
    else:
        first, second = kernels.grouped_gemm(x_sorted, w_gate_up, state.group_offsets).chunk(2, dim=-1)
        gate, up = (first, second) if spec.gate_first else (second, first)
    if spec.limit is not None:  # two elementwise passes beside the GLU kernel, which has no clamp of its own
        gate, up = gate.clamp(max=spec.limit), up.clamp(-spec.limit, spec.limit)
    glu, approximate = GLU_KERNELS[spec.activation]
    activated = kernels.swiglu(gate, up) if glu == "swiglu" else kernels.geglu(gate, up, approximate)
    return kernels.moe_unpermute(kernels.grouped_gemm(activated, w_down, state.group_offsets), weights, state)


def experts_unsupported_reason(variant: RoutedExpertsVariant) -> str | None:
    """Why these routed expert banks cannot run on the kernels (None when they can)."""
    needed = ("num_experts", "activation", "gate_first", "gate_up_bank", "down_bank", "gate_up_layout", "down_layout")
    missing = [k for k in needed if getattr(variant, k) is None]
    if missing:
        return f"variant lacks {', '.join(missing)}: the probe confirmed no gated-expert reading of the banks"
    if variant.activation not in GLU_KERNELS:
        return f"expert activation {variant.activation!r} has no GLU kernel (have {sorted(GLU_KERNELS)})"
    if {variant.gate_up_layout, variant.down_layout} - {"out_in", "in_out"}:
        return f"unknown bank layout {variant.gate_up_layout!r}/{variant.down_layout!r}"
    return None


def experts_forward(module: nn.Module, component: Component) -> Callable[..., Any]:
    """Replacement ``forward(hidden_states, top_k_index, top_k_weights)`` for confirmed routed expert banks: the
    block's own routing (hash, sparse mixer, zero-computation experts: whatever it is) chooses, the kernels compute."""
    v = component.variant
    reason = experts_unsupported_reason(v)
    if reason:
        raise ValueError(f"{component.module}: {reason}")
    local = functools.partial(local_path, base=component.module)
    gate_up_path, down_path = local(v.gate_up_bank), local(v.down_bank)
    up_path = local(v.up_bank) if v.up_bank else None
    banks = functools.partial(_bank_views, module, v, gate_up_path, down_path, up_path)
    spec = RoutedExperts(
        num_experts=int(v.num_experts),
        top_k=int(v.top_k or 1),
        activation=v.activation,
        gate_first=bool(v.gate_first),
        limit=float(v.limit) if v.limit is not None else None,
    )

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        gate_up, down, up = banks()
        return chosen_experts(hidden_states, top_k_weights, top_k_index, gate_up, down, spec, up).to(
            hidden_states.dtype
        )

    return forward


def moe_forward(module: nn.Module, component: Component) -> Callable[..., Any]:
    """Replacement ``forward(hidden_states)`` for the confirmed MoE ``module`` (path ``component.module``)."""
    v = component.variant
    reason = unsupported_reason(v)
    if reason:
        raise ValueError(f"{component.module}: {reason}")
    local = functools.partial(local_path, base=component.module)
    router_path = local(v.router)
    gate_up_path, down_path = local(v.gate_up_bank), local(v.down_bank)
    up_path = local(v.up_bank) if v.up_bank else None
    # row-stacked 2-D banks ([E x rows, width]) are read as [E, rows, width] views, no copy
    as_bank = (lambda w: w.view(int(v.num_experts), -1, w.shape[-1])) if v.bank_rows else (lambda w: w)  # noqa: E731
    shared_path = local(v.shared_experts) if v.shared_experts else None
    output_bias = v.output_bias
    # banks are stored [E, out, in] ("out_in", F.linear orientation) or [E, in, out]; the GEMM wants [E, in, out]
    banks = functools.partial(_bank_views, module, v, gate_up_path, down_path, up_path)
    router_weight, router_bias, correction = v.router_weight, v.router_bias, v.correction_bias
    logits_output = v.router_logits_output
    with_logits = v.outputs == "hidden+router_logits"
    spec = RoutedExperts(
        num_experts=int(v.num_experts),
        top_k=int(v.top_k),
        scoring=v.scoring,
        n_group=int(v.n_group),
        topk_group=int(v.topk_group),
        normalize=bool(v.normalize_topk),
        scale=float(v.routed_scale),
        activation=v.activation,
        gate_first=bool(v.gate_first),
    )

    def forward(hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        router = module.get_submodule(router_path)
        if logits_output is not None and router_path:
            # the router module runs (its hooks fire: transformers records router logits there for the
            # load-balancing loss); only its logits are used, its own top-k result is discarded
            out = router(x)
            logits = out[logits_output] if isinstance(out, tuple) else out
        else:
            logits = router_logits(
                x, dotted_attr(router, router_weight), dotted_attr(router, router_bias) if router_bias else None
            )
        gate_up, down, up = banks(as_bank)
        routed = routed_experts(
            x, logits, gate_up, down, spec, dotted_attr(router, correction) if correction else None, up
        )
        out = routed.to(hidden_states.dtype).view(hidden_states.shape)
        if shared_path is not None:
            out = out + module.get_submodule(shared_path)(hidden_states)
        if output_bias is not None:
            out = out + getattr(module, output_bias)
        return (out, logits) if with_logits else out

    return forward


def _bank_views(module: nn.Module, v, gate_up_path: str, down_path: str, up_path: str | None, as_bank=None):
    """(gate/up, down, up or None) banks as the grouped GEMM takes them, ``[E, in, out]``: looked up on ``module``
    on every call (parameter swaps are seen) and transposed where they are stored ``[E, out, in]``."""
    view = as_bank or (lambda w: w)
    gate_up, down = view(module.get_parameter(gate_up_path)), view(module.get_parameter(down_path))
    up = view(module.get_parameter(up_path)) if up_path else None
    if v.gate_up_layout == "out_in":
        gate_up, up = gate_up.transpose(1, 2), up.transpose(1, 2) if up is not None else None
    return gate_up, down.transpose(1, 2) if v.down_layout == "out_in" else down, up


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Router projection in the wider of the activation and router dtypes (an fp32 router sees fp32 inputs)."""
    dtype = torch.promote_types(x.dtype, weight.dtype)
    return F.linear(x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None)
