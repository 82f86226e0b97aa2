"""The kernel library's public functions: argument checks, then one ``torch.ops.adapt`` operator each.

Checks run here, in Python the tracer follows, so a bad call fails the same way eager or compiled.
The operators (``ops``) carry autograd; these functions only decide whether the forward must keep what
a backward needs (nothing is stored for inference).
"""

from __future__ import annotations

import torch

from . import flops, moe_ops, norms, ops, optim_ops  # noqa: F401  (the torch.ops.adapt operators, FLOP formulas)
from . import gemm as gemm_kernels
from ._utils import check_float
from .cross_entropy import REDUCTIONS
from .gemm import GemmConfig
from .glu import ACTIVATIONS
from .moe import SCORINGS, PermutationState
from .norms import CAST_MODES, RowConfig

_adapt = torch.ops.adapt


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_norm(x: torch.Tensor, weight: torch.Tensor, cast: str | None = None) -> None:
    check_float("x", x)
    if cast is not None and cast not in CAST_MODES:
        raise ValueError(f"cast must be one of {sorted(CAST_MODES)}, got {cast!r}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match width {x.shape[-1]}")


def rms_norm(x, weight, eps=1e-6, offset=0.0, cast="round_then_scale", config: RowConfig | None = None):
    """RMSNorm over the last dim: ``x / rms(x) * (offset + weight)`` with the model's casting order."""
    _check_norm(x, weight, cast)
    y, _ = _adapt.rms_norm(
        x, weight, float(eps), float(offset), cast, norms.encode_config(config), _needs_grad(x, weight)
    )
    return y


def add_rms_norm(x, residual, weight, eps=1e-6, offset=0.0, cast="round_then_scale", config: RowConfig | None = None):
    """``s = x + residual`` (rounded to the input dtype) and ``rms_norm(s)`` in one pass: returns (s, normed)."""
    _check_norm(x, weight, cast)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError("residual must match x in shape and dtype")
    total, y, _ = _adapt.add_rms_norm(
        x,
        residual,
        weight,
        float(eps),
        float(offset),
        cast,
        norms.encode_config(config),
        _needs_grad(x, residual, weight),
    )
    return total, y


def layer_norm(x, weight, bias=None, eps=1e-5, config: RowConfig | None = None):
    """LayerNorm over the last dim, statistics in fp32, optional bias."""
    _check_norm(x, weight)
    if bias is not None and tuple(bias.shape) != tuple(weight.shape):
        raise ValueError(f"weight/bias must have shape ({x.shape[-1]},)")
    y, _, _ = _adapt.layer_norm(x, weight, bias, float(eps), norms.encode_config(config), _needs_grad(x, weight, bias))
    return y


def _glu(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    check_float("gate", gate)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} must match")
    return _adapt.glu(gate, up, activation)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return _glu(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate, approximate) * up`` with ``approximate`` in {"none", "tanh"} as in ``F.gelu``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _glu(gate, up, "gelu" if approximate == "none" else "gelu_tanh")


def glu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> torch.Tensor:
    """``F.linear(act(gate) * up, weight, bias)`` with ``activation`` in ``glu.ACTIVATIONS`` ("silu", "gelu",
    "gelu_tanh"), keeping gate and up but not their product for the backward."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    check_float("gate", gate)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} must match")
    if weight.dim() != 2 or weight.shape[1] != gate.shape[-1] or weight.dtype != gate.dtype:
        raise ValueError(
            f"weight must be [out, {gate.shape[-1]}] in {gate.dtype}, got {tuple(weight.shape)} {weight.dtype}"
        )
    return _adapt.glu_linear(gate, up, weight, bias, activation)


def apply_rotary(q, k, cos, sin, interleaved: bool = False, rotary_dim: int | None = None):
    """Rotate q ``[b, hq, s, d]`` and k ``[b, hk, s, d]`` by HF-layout ``cos``/``sin`` ``[b or 1, s, r]``.

    ``rotary_dim`` defaults to ``cos.shape[-1]``; dims past it are left unrotated (partial rotary).
    No gradient flows to ``cos``/``sin`` (they are functions of positions, not parameters).
    """
    check_float("q", q)
    check_float("k", k)
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [b, h, s, d] with equal b, s, d")
    if cos.dim() == 4 and cos.shape[1] == 1:  # HF's unsqueezed [b, 1, s, r]
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    rotary_dim = rotary_dim or cos.shape[-1]
    bsz, _, seq, dim = q.shape
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, bsz) or cos.shape[1] != seq:
        raise ValueError(f"cos/sin {tuple(cos.shape)} must be [1 or {bsz}, {seq}, rotary_dim]")
    if rotary_dim % 2 or rotary_dim > dim or cos.shape[-1] != rotary_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even, <= head dim {dim} and equal the cos width")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("apply_rotary does not differentiate through cos/sin; pass them detached")
    return _adapt.apply_rotary(q, k, cos, sin, bool(interleaved), int(rotary_dim))


def fused_linear_cross_entropy(
    hidden,
    weight,
    labels,
    bias=None,
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    reduction="mean",
    chunk_size: int | None = None,
):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` without the full logits.

    ``hidden`` is ``[..., H]`` and ``labels`` the matching ``[...]``; ``softcap`` applies
    ``softcap * tanh(logits / softcap)`` first (Gemma 2); ``z_loss`` adds ``z_loss * lse**2`` per token.
    The mean is over non-ignored tokens (0 when every token is ignored).
    """
    check_float("hidden", hidden)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must match the token dims of hidden {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight must be [vocab, {hidden.shape[-1]}] in {hidden.dtype}, got {tuple(weight.shape)} {weight.dtype}"
        )
    if not 0.0 <= label_smoothing <= 1.0 or z_loss < 0.0 or (softcap is not None and softcap <= 0.0):
        raise ValueError("need 0 <= label_smoothing <= 1, z_loss >= 0 and softcap > 0")
    grad = torch.is_grad_enabled()
    loss, *_ = _adapt.fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1).contiguous(),
        bias,
        int(ignore_index),
        float(label_smoothing),
        float(z_loss),
        float(softcap) if softcap is not None else None,
        reduction,
        chunk_size,
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    )
    return loss.view(labels.shape) if reduction == "none" else loss


def moe_route(
    router_logits, top_k, scoring="softmax", n_group=1, topk_group=1, normalize=True, correction_bias=None, scale=1.0
):
    """Top-k expert choice per token: returns (fp32 weights ``[T, k]``, int64 expert ids ``[T, k]``).

    ``scoring`` is "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3); ``n_group``/``topk_group``
    restrict the choice to the best groups; ``correction_bias`` shifts the choice only.
    """
    check_float("router_logits", router_logits)
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {sorted(SCORINGS)}, got {scoring!r}")
    logits = router_logits.reshape(-1, router_logits.shape[-1])
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    experts = logits.shape[1]
    if not 1 <= top_k <= experts or experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"invalid routing: top_k={top_k}, experts={experts}, n_group={n_group}, topk_group={topk_group}"
        )
    if n_group > 1 and experts // n_group < 2:
        raise ValueError("grouped routing scores a group by its two best experts: need >= 2 experts per group")
    if n_group > 1 and top_k > topk_group * (experts // n_group):
        raise ValueError("top_k exceeds the experts left after group selection")
    if correction_bias is not None and correction_bias.shape != (experts,):
        raise ValueError(f"correction_bias must have shape ({experts},)")
    return _adapt.moe_route(
        logits, int(top_k), scoring, int(n_group), int(topk_group), bool(normalize), correction_bias, float(scale)
    )


def moe_permute(x, expert_ids, num_experts):
    """Rows of ``x`` ``[T, H]`` replicated per chosen expert and sorted by expert: (x_sorted, state)."""
    check_float("x", x)
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0] or x.dim() != 2:
        raise ValueError(f"need x [T, H] and expert_ids [T, k], got {tuple(x.shape)}, {tuple(expert_ids.shape)}")
    tokens, top_k = expert_ids.shape
    source, position, offsets = _adapt.moe_sort(expert_ids, int(num_experts))
    state = PermutationState(
        source_token=source, sorted_position=position, group_offsets=offsets, num_tokens=tokens, top_k=top_k
    )
    x_rows = x if x.stride(-1) == 1 else x.contiguous()
    return _adapt.moe_permute(x_rows, source, position), state


def moe_unpermute(y_sorted, weights, state: PermutationState):
    """``y[t] = sum_k weights[t, k] * y_sorted[row of (t, k)]``, in ``y_sorted``'s dtype."""
    check_float("y_sorted", y_sorted)
    if weights.shape != (state.num_tokens, state.top_k):
        raise ValueError(f"weights must be [{state.num_tokens}, {state.top_k}], got {tuple(weights.shape)}")
    y_rows = y_sorted if y_sorted.stride(-1) == 1 else y_sorted.contiguous()
    return _adapt.moe_unpermute(y_rows, weights.contiguous(), state.sorted_position)


def grouped_gemm(
    x_sorted: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, config: GemmConfig | None = None
) -> torch.Tensor:
    """Per-expert ``x_sorted[offsets[e]:offsets[e+1]] @ w[e]`` with ``w`` of shape ``[E, K, N]``.

    ``group_offsets`` has ``E + 1`` entries (as produced by ``moe_permute``). fp32 inputs use exact
    fp32 products (no TF32); bf16/fp16 accumulate in fp32.
    """
    check_float("x_sorted", x_sorted)
    if x_sorted.dim() != 2 or w.dim() != 3 or w.shape[1] != x_sorted.shape[1] or w.dtype != x_sorted.dtype:
        raise ValueError(f"need x [M, K] and w [E, K, N] of one dtype, got {tuple(x_sorted.shape)}, {tuple(w.shape)}")
    if group_offsets.shape != (w.shape[0] + 1,):
        raise ValueError(f"group_offsets must have E + 1 = {w.shape[0] + 1} entries")
    if x_sorted.stride(1) != 1:
        x_sorted = x_sorted.contiguous()
    return _adapt.grouped_gemm(x_sorted, w, group_offsets.to(torch.int64), gemm_kernels.encode_config(config))
