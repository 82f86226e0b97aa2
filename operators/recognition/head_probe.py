"""Numeric confirmation of the vocabulary projection + cross-entropy (the fused loss against the model's own), and of
the vocabulary projection alone where the trace holds no loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from adapt.model.calls import without_cache
from operators.recognition.probes import close, first_tensor, grads_match, redrawn_copy, with_fresh_hidden

_PROBE_LOGIT_SCALE = 60.0  # largest logit during the loss probe, about twice the usual final soft-caps


def probe_lm_head_loss(model: nn.Module, head_path: str, softcap: float | None, generator) -> tuple[bool, str]:
    """Does cross-entropy of ``softcap(decoder output @ head.weight.T)`` reproduce the model's own loss?

    Runs the linear-cross-entropy forward (``operators.providers.triton_head``) with a float64 PyTorch
    loss against the model's forward on fresh random tokens and labels (some ignored), comparing the
    loss and the head weight's gradient.  The head weight is scaled for the probe (and restored bit for
    bit) so the largest logit is about 60.  Returns (confirmed, evidence or reason).
    """
    from operators.providers.triton_head import (
        head_owner,
        linear_cross_entropy_forward,
        reference_linear_cross_entropy,
    )

    head = model.get_submodule(head_path)
    try:
        owner = head_owner(model, head)
        fused = linear_cross_entropy_forward(owner, softcap, reference_linear_cross_entropy)
    except (ValueError, AttributeError, NotImplementedError) as err:
        return False, f"no linear-cross-entropy forward: {err}"
    device = head.weight.device
    ids = torch.randint(0, head.weight.shape[0], (2, 9), generator=generator).to(device)
    labels = torch.where(torch.rand(ids.shape, generator=generator).to(device) < 0.25, -100, ids)
    extra = without_cache(owner)
    # Gradients upstream of the decoder output are the same computation in both paths; the head weight's
    # gradient (which includes the embedding's when tied) is where the loss composition can differ.
    # Asking for it alone skips every other weight gradient: the probe costs a forward at any depth.
    params = [head.weight]
    training, saved_weight = model.training, head.weight.detach().clone()
    model.eval()
    try:
        with torch.no_grad():  # logits of tens: a final soft-cap (or its absence) then changes the loss at O(1)
            logits = owner(input_ids=ids, **extra).logits
            head.weight.mul_(_PROBE_LOGIT_SCALE / max(float(logits.abs().max()), 1e-6))
        want = owner(input_ids=ids, labels=labels, **extra).loss
        got = fused(input_ids=ids, labels=labels, **extra).loss
        want_grads = torch.autograd.grad(want, params, allow_unused=True)
        got_grads = torch.autograd.grad(got, params, allow_unused=True)
    except Exception as err:  # a model whose loss is not this composition may fail anywhere in it
        return False, f"fused-loss forward failed: {type(err).__name__}: {str(err)[:160]}"
    finally:
        fused.release()
        model.train(training)
        with torch.no_grad():
            head.weight.copy_(saved_weight)
    if not close(got.float(), want.float(), rtol=1e-5, atol=1e-6):
        return False, f"loss {float(got.detach()):.6g} differs from the model's own {float(want.detach()):.6g}"
    for g, w in zip(got_grads, want_grads):
        if (g is None) != (w is None) or (g is not None and not close(g.float(), w.float(), rtol=1e-4, atol=1e-5)):
            return False, "loss matches but the head weight's gradient differs"
    return True, "float64 linear cross-entropy of the decoder output reproduces the model's loss and gradients"


def probe_vocab_projection(module: nn.Module, call: tuple[tuple, dict], generator) -> dict[str, Any] | None:
    """Is the head ``x @ W.T (+ b)`` of its ``[out, in]`` matrix and, if it adds one, its ``[out]`` shift?  Checked on
    a float64 copy with fresh parameters and input, outputs and gradients; the names that matched, or None."""
    m = redrawn_copy(module, generator, scale=0.3).eval()
    x, args, kwargs = with_fresh_hidden(*call, generator)
    params = dict(m.named_parameters())
    matrices = [n for n, p in params.items() if p.dim() == 2]
    leaves = [x, *params.values()]

    def run() -> torch.Tensor:
        return first_tensor(m(*args, **kwargs))

    for weight in matrices:
        shifts = [n for n, p in params.items() if p.dim() == 1 and p.shape[0] == params[weight].shape[0]]
        for bias in [None, *shifts]:
            shift = params[bias] if bias else None
            if grads_match(
                run, lambda weight=weight, shift=shift: F.linear(x, params[weight], shift), leaves, generator
            ):
                return {"weight": weight, "bias": bias}
    return None
