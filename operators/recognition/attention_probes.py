"""Numeric confirmation of attention: which keys each query sees, measured through gradients, and whether a plain
scaled-dot-product core reproduces the module's own."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from operators.recognition.probes import first_tensor, grads_match, redrawn_copy, with_fresh_hidden


def attention_visibility(module: nn.Module, args: tuple, kwargs: dict, generator) -> dict[str, Any]:
    """For every query position, the set of positions its output depends on (batch row 0).

    The mask semantics (causal, bidirectional, sliding window) come out of the module's own
    behaviour with the inputs the model really gave it, not from any attribute.
    """
    m = redrawn_copy(module, generator, scale=0.2)
    x, call_args, call_kwargs = with_fresh_hidden(args, kwargs, generator)
    out = first_tensor(m(*call_args, **call_kwargs))
    seq = x.shape[1]
    visible = []
    for i in range(seq):
        (grad,) = torch.autograd.grad(out[0, i].sum(), x, retain_graph=True)
        visible.append([j for j in range(seq) if float(grad[0, j].abs().max()) > 0.0])
    causal = all(max(v) <= i for i, v in enumerate(visible) if v)
    spans = [i - min(v) + 1 for i, v in enumerate(visible) if v]
    full = all(len(v) == (i + 1 if causal else seq) for i, v in enumerate(visible))
    window = None if full else (max(spans) if causal else None)
    return {"causal": causal, "window": window, "seq_len": seq}


_PROBE_CORE_NAME = "adapt_probe_reference"


def attention_core_matches(
    module: nn.Module, args: tuple, kwargs: dict, variant: dict[str, Any], generator
) -> tuple[bool, str]:
    """Does the module still compute the same function when its attention core is the plain kernel?

    The kernel that replaces a hooked attention core sees (q, k, v, mask, scaling), the recognised
    causal/window/softcap/GQA values and, where recognition found sinks, the per-head sink logits the module
    hands its core as ``s_aux``; nothing else: relative-position terms or any other keyword are dropped.  So the
    float64 module is run twice on one fresh input, with its own core and with a float64 reference of that kernel,
    and must agree in output and in every gradient (a parameter only the model's own core reads gets no gradient
    through the kernel).
    """
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(_PROBE_CORE_NAME, functools.partial(_reference_core, variant=dict(variant)))
    m = redrawn_copy(module, generator, scale=0.2).eval()
    config = m.config
    own = config._attn_implementation
    x, call_args, call_kwargs = with_fresh_hidden(args, kwargs, generator)

    def run(implementation: str) -> torch.Tensor:
        config._attn_implementation = implementation
        try:
            return first_tensor(m(*call_args, **call_kwargs))
        finally:
            config._attn_implementation = own

    if grads_match(lambda: run(own), lambda: run(_PROBE_CORE_NAME), [x, *m.parameters()], generator):
        return True, "the module with a plain scaled-dot-product core reproduces its own float64 output and gradients"
    return (
        False,
        "its attention core computes more than scaled dot-product attention with the measured mask (e.g. sinks or position terms)",
    )


def _reference_core(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    variant: dict[str, Any],
    **extra,
):
    """Float64 scaled dot-product attention as the replacing kernel computes it: with recognised sinks, the module's
    ``s_aux`` logits join each row's softmax and are dropped after it; other keywords are ignored as it ignores them."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scale
    cap = variant.get("softcap")
    if cap:
        scores = cap * torch.tanh(scores / cap)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask = (
        attention_mask[:, :, :, :kv_len] if attention_mask is not None and attention_mask.dim() == 4 else attention_mask
    )
    if mask is None:
        q_pos = torch.arange(q_len).view(-1, 1) + (kv_len - q_len)
        k_pos = torch.arange(kv_len).view(1, -1)
        mask = torch.ones(q_len, kv_len, dtype=torch.bool)
        if variant.get("causal", True):
            mask &= k_pos <= q_pos
        if variant.get("window"):
            mask &= (q_pos - k_pos) < int(variant["window"])
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.to(scores.dtype)
    sinks = extra.get("s_aux") if variant.get("sinks") else None
    if sinks is None:
        return (torch.softmax(scores, dim=-1) @ value).transpose(1, 2).contiguous(), None
    column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return (probs @ value).transpose(1, 2).contiguous(), None
