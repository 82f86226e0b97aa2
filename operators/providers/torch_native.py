"""PyTorch's own fused ops: ``F.rms_norm``, ``F.layer_norm``, SDPA and FlexAttention.

Attention is intercepted through the model's attention-function hook (``config._attn_implementation``
resolved through transformers' ``AttentionInterface``) when the recognised attention module exposes
one; the kernel is parameterised by the *recognised* causal/window/softcap/GQA values and refuses to
run if the model's call disagrees with them.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from operators.recognition.component import Component
from operators.recognition.variants import AttentionVariant
from operators.registry import KernelOption, Target

ATTENTION_HOOK_NAME = "adapt"
# attention module -> (recognised variant, call counter); read by the registered attention function
_ATTENTION_SPECS: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


class TorchNativeProvider:
    name = "torch-native"

    def available(self, target: Target) -> tuple[bool, str]:
        return True, ""

    def options(self, component: Component, target: Target) -> list[KernelOption]:
        v = component.variant
        if component.kind in ("rms_norm", "layer_norm") and component.confirmed and v.already_fused:
            return [KernelOption(self.name, "fused ATen norm (already in the graph)", "fused", None)]
        if component.kind == "rms_norm" and component.confirmed:
            return [KernelOption(self.name, "F.rms_norm", "fused", rms_norm_forward, ["aten._fused_rms_norm.default"])]
        if component.kind == "layer_norm" and component.confirmed:
            return [
                KernelOption(self.name, "F.layer_norm", "fused", layer_norm_forward, ["aten.native_layer_norm.default"])
            ]
        if component.kind == "attention" and component.confirmed:
            return self._attention(component, target)
        if component.kind in ("gated_mlp", "mlp") and component.confirmed:
            return [KernelOption(self.name, f"aten mm + {v.activation} (eager)", "native", None)]
        if component.kind == "projection_activation" and component.confirmed:
            normed = f" + {v.norm}" if v.norm else ""
            return [KernelOption(self.name, f"aten linear + {v.activation}{normed} as traced", "native", None)]
        if component.kind == "projection_residual_norm" and component.confirmed:
            normed = f" + {v.norm}" if v.norm else ""
            return [
                KernelOption(
                    self.name,
                    f"aten linear + add{normed} as traced",
                    "native",
                    None,
                    note="its norm keeps its own kernel choice (a fused add + norm where one exists)" if v.norm else "",
                )
            ]
        if component.kind == "moe":
            return [KernelOption(self.name, "router + expert GEMMs as traced", "native", None)]
        if component.kind == "routed_experts":
            return [KernelOption(self.name, "expert GEMMs as traced", "native", None)]
        if component.kind == "vocab_projection" and component.confirmed:
            return [KernelOption(self.name, "aten linear as traced", "native", None)]
        if (
            component.kind == "rotary_application"
            and component.confirmed
            and (v.table, v.layout) != ("cos_sin", "bhsd")
        ):
            return [
                KernelOption(
                    self.name,
                    f"{v.function} as traced",
                    "native",
                    None,
                    note=f"the rope kernel stands in for a (q, k, cos, sin) function on [b, h, s, d] heads; this one takes "
                    f"a {v.table.replace('_', '/')} table and {v.layout} heads",
                )
            ]
        if component.kind in ("rotary", "embedding", "activation", "residual_add_norm", "lm_head_cross_entropy"):
            return [KernelOption(self.name, "aten ops as traced", "native", None)]
        return []

    def _attention(self, component: Component, target: Target) -> list[KernelOption]:
        v = component.variant
        plain = not v.softcap and not v.sinks
        if v.core == "sdpa" and plain:
            return [KernelOption(self.name, "SDPA (already in the graph)", "fused", None, [])]
        if not v.hook:
            return [
                KernelOption(
                    self.name,
                    "aten bmm/softmax (no interception point)",
                    "native",
                    None,
                    note="module computes attention inline",
                )
            ]
        if plain:
            return [
                KernelOption(
                    self.name,
                    "SDPA",
                    "fused",
                    attention_forward,
                    ["aten._scaled_dot_product_efficient_attention.default"],
                )
            ]
        if target.device == "cpu" and target.training:
            return []  # FlexAttention has no CPU backward
        return [
            KernelOption(
                self.name,
                "FlexAttention",
                "fused",
                attention_forward,
                ["higher_order.flex_attention"],
                needs_codegen="triton" if target.device == "cuda" else None,
            )
        ]


# ---------------------------------------------------------------------------------------------
# Replacement forwards: read the module's own parameters (by the names recognition found) per call,
# so FSDP2/TP parameter swaps are seen and state_dict is untouched.
# ---------------------------------------------------------------------------------------------


def rms_norm_forward(module: nn.Module, component: Component):
    v = component.variant
    eps, offset, cast, w_name = float(v.eps), float(v.offset), v.cast, v.weight

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = getattr(module, w_name) if w_name else None
        width = (x.shape[-1],)
        if weight is None:
            return F.rms_norm(x.float(), width, None, eps).to(x.dtype)
        if x.dtype == torch.float32 and weight.dtype == torch.float32 and offset == 0.0:
            return F.rms_norm(x, width, weight, eps)
        normed = F.rms_norm(x.float(), width, None, eps)
        if cast == "scale_then_round":
            return (normed * (offset + weight.float())).to(x.dtype)
        return (offset + weight) * normed.to(x.dtype)

    return forward


def layer_norm_forward(module: nn.Module, component: Component):
    v = component.variant
    eps, w_name, b_name = float(v.eps), v.weight, v.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = getattr(module, w_name) if w_name else None
        bias = getattr(module, b_name) if b_name else None
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    return forward


def attention_forward(module: nn.Module, component: Component):
    """Not a forward replacement: registers the recognised variant for ``module`` and returns None
    so the patcher only flips the model's attention hook (see ``operators.patch``)."""
    _ATTENTION_SPECS[module] = {"variant": component.variant, "calls": 0}
    return None


def attention_calls(module: nn.Module) -> int:
    """Eager calls of the adapt attention function for ``module`` (compiled calls are not counted)."""
    spec = _ATTENTION_SPECS.get(module)
    return spec["calls"] if spec else 0


def forget_attention(module: nn.Module) -> None:
    _ATTENTION_SPECS.pop(module, None)


def adapt_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
):
    """transformers attention-function signature; q/k/v are [B, H, T, D]; returns ([B, T, H, D], None)."""
    spec = _ATTENTION_SPECS.get(module)
    if spec is None:
        raise RuntimeError("adapt attention hook called for a module without a recognised attention plan")
    v = spec["variant"]
    _check_agrees(v, kwargs)
    if not torch.compiler.is_compiling():  # a traced count would be a guarded constant: one recompile per call
        spec["calls"] += 1
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    dropout_p = dropout if module.training else 0.0
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask = attention_mask
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, :kv_len]
    if mask is None and (v.window or not v.causal):
        mask = _band(q_len, kv_len, v, query.device)
    gqa = query.shape[1] != key.shape[1]
    if v.softcap or v.sinks:
        sinks = kwargs.get("s_aux") if v.sinks else None  # transformers' name for learned per-head sink logits
        if v.sinks and sinks is None:
            raise RuntimeError("attention recognised with sinks, but the model's call passed no s_aux")
        out = _flex(query, key, value, mask, v, scale, gqa, sinks)
    else:
        is_causal = bool(v.causal) and mask is None and q_len == kv_len
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous(), None


def _check_agrees(v: AttentionVariant, kwargs: dict[str, Any]) -> None:
    """The model's call must agree with what recognition measured; a disagreement is a recognition bug."""
    softcap = kwargs.get("softcap")
    if softcap is not None and v.softcap is not None and abs(float(softcap) - float(v.softcap)) > 1e-9:
        raise RuntimeError(f"attention softcap {softcap} differs from the recognised {v.softcap}")


def _band(q_len: int, kv_len: int, v: AttentionVariant, device) -> torch.Tensor:
    q = torch.arange(q_len, device=device).view(-1, 1) + (kv_len - q_len)
    k = torch.arange(kv_len, device=device).view(1, -1)
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if v.causal:
        allowed &= k <= q
    if v.window:
        allowed &= (q - k) < int(v.window)
    return allowed.view(1, 1, q_len, kv_len)


FLEX_BLOCK = 128  # FlexAttention's default block: its block masks are built and skipped in tiles of this many tokens


def _visible_blocks(q_len: int, kv_len: int, v: AttentionVariant, device):
    """FlexAttention's block mask of the recognised causal window, so blocks no query sees are skipped (a sliding
    window of 128 over 2048 tokens computes a sixteenth of the square); None when every key is visible, and for
    lengths that are not whole blocks: there a block mask has little to skip, and torch 2.11's Inductor found no
    kernel for one over 64 tokens on the H200 (the call then runs without it, on the same mask).  The score mod
    still applies the model's own mask, which may hide more (padding)."""
    if (not v.causal and not v.window) or q_len % FLEX_BLOCK or kv_len % FLEX_BLOCK:
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    offset, window = kv_len - q_len, int(v.window or 0)

    def visible(b, h, q_idx, kv_idx):
        position = q_idx + offset
        allowed = kv_idx <= position if v.causal else kv_idx >= 0
        if window:
            allowed = allowed & (position - kv_idx < window)
        return allowed

    return create_block_mask(visible, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device)


def _flex(query, key, value, mask, v, scale, gqa, sinks=None):
    """FlexAttention with the recognised soft-cap and mask.  Learned sinks (one logit per head that joins every
    row's softmax and is dropped after it) scale the output by the mass left on the keys: with ``lse`` the keys'
    log-sum-exp, ``sigmoid(lse - sink)``; gradients reach the sinks and the scores through ``lse``."""
    from torch.nn.attention.flex_attention import flex_attention

    cap = float(v.softcap) if v.softcap else None
    bool_mask = mask if mask is None or mask.dtype == torch.bool else mask > -1e30
    additive = None if mask is None or mask.dtype == torch.bool else mask

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if additive is not None:
            return score + additive[b, 0, q_idx, kv_idx]
        if bool_mask is not None:
            return torch.where(bool_mask[b if bool_mask.shape[0] > 1 else 0, 0, q_idx, kv_idx], score, -float("inf"))
        return score

    blocks = _visible_blocks(query.shape[-2], key.shape[-2], v, query.device)
    if sinks is None:
        return flex_attention(query, key, value, score_mod=score_mod, block_mask=blocks, scale=scale, enable_gqa=gqa)
    out, lse = flex_attention(
        query, key, value, score_mod=score_mod, block_mask=blocks, scale=scale, enable_gqa=gqa, return_lse=True
    )
    on_keys = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))
    return (out.to(lse.dtype) * on_keys.unsqueeze(-1)).to(out.dtype)
