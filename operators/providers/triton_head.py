"""Fused linear cross-entropy for a causal LM's training forward: the ``[tokens, vocab]`` logits never exist.

The model keeps its own forward.  When ``labels`` are given, the patched forward calls it with
``logits_to_keep`` set to an empty index (the vocabulary projection then runs on zero positions),
captures the decoder's full output through a forward hook on ``get_decoder()``, and lends the model
a ``loss_function`` (transformers' own hook for the loss) that computes the cross-entropy of those
hidden states against ``get_output_embeddings()``'s weight, tied or not, with transformers' label
shift, ``ignore_index``, ``num_items_in_batch`` and the final logit soft-cap.  Everything the model
adds to the loss itself (MoE auxiliary losses) still happens.  Without labels the original forward
runs unchanged.  The same mechanism with a float64 loss is the recognition probe.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from operators.recognition.component import Component

# (hidden [..., H], weight [V, H], labels [...], bias, ignore_index, softcap, reduction) -> loss
LinearCrossEntropy = Callable[..., torch.Tensor]
_MISSING = object()


def reference_linear_cross_entropy(
    hidden, weight, labels, bias=None, ignore_index=-100, softcap=None, reduction="mean"
):
    """float64 PyTorch reference of ``fused_linear_cross_entropy`` (used by the recognition probe)."""
    logits = F.linear(hidden.double(), weight.double(), bias.double() if bias is not None else None)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction=reduction)


def triton_linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, softcap=None, reduction="mean"):
    from operators.kernels import fused_linear_cross_entropy

    return fused_linear_cross_entropy(
        hidden, weight, labels, bias, ignore_index=ignore_index, softcap=softcap, reduction=reduction
    )


def head_owner(model: nn.Module, head: nn.Module) -> nn.Module:
    """The outermost module whose ``get_output_embeddings()`` is ``head`` (the causal-LM wrapper)."""
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if callable(getter) and getter() is head:
            return module
    raise ValueError("no module returns this projection from get_output_embeddings()")


@dataclass
class _FusedCall:
    """One labelled forward in progress: the decoder output it captured and whether its loss ran."""

    shift_requested: bool
    hidden: list[torch.Tensor] = field(default_factory=list)
    used: bool = False


def linear_cross_entropy_forward(
    owner: nn.Module, softcap: float | None, loss: LinearCrossEntropy
) -> Callable[..., Any]:
    """``owner``'s forward with the loss computed by ``loss`` from the decoder output when labels are given.

    The decoder hook and the lent ``loss_function`` are installed here, once, and act only while a
    labelled call of this forward runs (they defer to the model otherwise): installing them per call
    would put hook registration inside the forward, which Dynamo cannot trace.  The returned forward's
    ``release()`` removes both.
    """
    inner = owner.forward
    params = list(inspect.signature(inner).parameters)
    if "logits_to_keep" not in params or "labels" not in params:
        raise ValueError(f"{type(owner).__name__}.forward takes no labels/logits_to_keep: the logits cannot be skipped")
    decoder, head = owner.get_decoder(), owner.get_output_embeddings()
    if decoder is owner or decoder is None:
        raise ValueError("get_decoder() does not return a separate decoder module")
    labels_at, keep_at = params.index("labels"), params.index("logits_to_keep")
    calls: list[_FusedCall] = []  # the labelled calls in progress, innermost last
    model_loss = owner.loss_function

    def capture(module, inputs, output):
        if calls:
            calls[-1].hidden.append(output if isinstance(output, torch.Tensor) else output[0])

    def fused_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **_):
        call = calls[-1]
        if len(call.hidden) != 1:
            raise RuntimeError(f"the decoder ran {len(call.hidden)} times in one forward; expected once")
        if shift_labels is None:
            if call.shift_requested:  # never shift twice: the caller's labels are already aligned
                raise RuntimeError(f"{type(owner).__name__}.forward does not pass shift_labels on to its loss")
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        states = call.hidden[0]
        reduction = "mean" if num_items_in_batch is None else "sum"
        bias = getattr(head, "bias", None)
        value = loss(
            states,
            head.weight,
            shift_labels.to(states.device),
            bias,
            ignore_index=ignore_index,
            softcap=softcap,
            reduction=reduction,
        )
        call.used = True
        if num_items_in_batch is not None:
            value = value / (
                num_items_in_batch.to(value.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
            )
        return value

    def loss_function(*args, **kwargs):
        return fused_loss(*args, **kwargs) if calls else model_loss(*args, **kwargs)

    def forward(*args, **kwargs):
        labels = kwargs["labels"] if "labels" in kwargs else (args[labels_at] if len(args) > labels_at else None)
        if labels is None:
            return inner(*args, **kwargs)
        keep = torch.zeros(0, dtype=torch.long, device=head.weight.device)  # the projection runs on no position
        if len(args) > keep_at:
            args = (*args[:keep_at], keep, *args[keep_at + 1 :])
        else:
            kwargs = {**kwargs, "logits_to_keep": keep}
        call = _FusedCall(kwargs.get("shift_labels") is not None)
        calls.append(call)
        try:
            out = inner(*args, **kwargs)
        finally:
            calls.pop()
        if not call.used:
            raise RuntimeError("the model computed its loss without calling loss_function; the fused loss cannot apply")
        if (
            isinstance(out, OrderedDict) and "logits" in out
        ):  # a ModelOutput: drop the empty logits like any absent field
            out = type(out)(**{key: value for key, value in out.items() if key != "logits"})
        return out

    hook = decoder.register_forward_hook(capture)
    restore = _lend_loss_function(owner, loss_function)

    def release() -> None:
        hook.remove()
        restore()

    forward.adapt_fused_loss = True  # the trainer passes labels to a model patched this way
    forward.release = release
    return forward


def _lend_loss_function(owner: nn.Module, loss_function: Callable) -> Callable[[], None]:
    """Set ``owner.loss_function`` (transformers stores it through a property setter) and return an undo."""
    before = dict(vars(owner))
    owner.loss_function = loss_function
    changed = [k for k, v in vars(owner).items() if before.get(k, _MISSING) is not v]

    def restore() -> None:
        for key in changed:
            if key in before:
                vars(owner)[key] = before[key]
            else:
                vars(owner).pop(key, None)

    return restore


def head_forward(owner: nn.Module, component: Component):
    """adapt-triton factory: ``owner`` is the module that owns the head (see ``operators.patch``)."""
    softcap = component.variant.final_softcap
    return linear_cross_entropy_forward(owner, float(softcap) if softcap else None, triton_linear_cross_entropy)


def self_test_cases(gen: torch.Generator) -> dict[str, tuple]:
    """(kernel, float64 reference, inputs) for the provider's self-test: soft-capped, one ignored label."""
    labels = torch.randint(0, 40, (6,), generator=gen)
    labels[2] = -100
    return {
        "linear_cross_entropy": (
            lambda h, w: triton_linear_cross_entropy(h, w, labels.to(h.device), softcap=30.0),
            lambda h, w: reference_linear_cross_entropy(h, w, labels, softcap=30.0),
            (torch.randn(6, 16, generator=gen), torch.randn(40, 16, generator=gen)),
        )
    }
