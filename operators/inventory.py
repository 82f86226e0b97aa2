"""Operator inventory: every ATen op a model dispatches, attributed to the module that ran it.

``trace_model`` runs one forward and backward of a model at small shapes (``example_batch``, ``model_loss``)
and ``trace_callable`` one of any module, both under ``dispatch_trace``'s tracer; the ``OpInventory`` they
return is what recognition, mapping and the ops report read.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adapt.core.errors import ModelCannotRun
from adapt.model.calls import own_refusal, token_vocab, without_cache
from operators.dispatch_trace import ROOT, ModuleRecord, OpRecord, trace_ops


@dataclass
class OnnxReport:
    exported: bool
    opset: int | None = None
    checker: str = "not run"  # "ok" or the checker's message
    op_types: dict[str, int] = field(default_factory=dict)
    error: str | None = None


@dataclass
class OpInventory:
    ops: list[OpRecord]
    modules: dict[str, ModuleRecord]
    tracer: str  # how the ops were captured
    device: str  # "cpu" (real tensors) or "meta" (shape-only)
    with_backward: bool
    input_shape: list[int]
    seconds: float
    traced_blocks: list[str] = field(default_factory=list)  # meta mode: one module per distinct block
    onnx: OnnxReport | None = None
    # First-call inputs of every module (detached tensors), kept for probes; never serialised.
    captured: dict[str, tuple[tuple, dict]] = field(default_factory=dict, repr=False, compare=False)

    def overload_counts(self, phase: str | None = None) -> Counter:
        counts: Counter = Counter()
        for rec in self.ops:
            if phase is None or rec.phase == phase:
                counts[rec.overload] += rec.count
        return counts

    def ops_of(self, module: str, *, subtree: bool = True) -> list[OpRecord]:
        """Records owned by ``module`` (and its descendants when ``subtree``)."""
        prefix = module + "."
        return [
            r for r in self.ops if r.module == module or (subtree and (module == ROOT or r.module.startswith(prefix)))
        ]

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "captured"}
        return json_ready(data)


def json_ready(value: Any) -> Any:
    """``dataclasses.asdict`` that tolerates non-dataclass containers (used by every result type)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_ready(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, float) and value != value:
        return None
    return value


def example_batch(
    model: nn.Module, batch: int = 2, seq_len: int = 24, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Fresh random token ids inside the model's vocabulary."""
    vocab = token_vocab(model)
    return torch.randint(0, vocab, (batch, seq_len), device=device)


def model_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """A scalar that depends on every output: the LM loss when the model takes labels, else a sum of squares.

    A model whose loss needs more than token ids (an image-to-text model shifts its labels past image
    tokens that a text-only batch lacks) raises on the labelled call; its plain forward is traced instead.
    """
    extra = without_cache(model)
    try:
        out = model(input_ids=input_ids, labels=input_ids, **extra)
        loss = getattr(out, "loss", None)
        if loss is not None:
            return loss
    except (TypeError, ValueError):
        out = model(input_ids=input_ids, **extra)
    hidden = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", None)
    if hidden is None:
        hidden = out.logits
    return hidden.float().pow(2).mean()


def trace_model(
    model: nn.Module, *, seq_len: int = 24, batch: int = 2, backward: bool = True, capture: bool = True, seed: int = 0
) -> OpInventory:
    """Inventory of a model with real weights: one forward+backward at small shapes."""
    start = time.perf_counter()
    device = next(model.parameters()).device
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    ids = example_batch(model, batch, seq_len, device)
    torch.random.set_rng_state(generator_state)
    saved_grads = {p: p.grad for p in model.parameters()}  # the trace must leave no gradients behind
    try:
        records, modules, captured = trace_ops(model, lambda m: model_loss(m, ids), backward=backward, capture=capture)
    except Exception:
        # The model's first forward here: told apart from a failure of the trace by running it plainly
        refusal = own_refusal(model, ids)
        if refusal is not None:
            raise ModelCannotRun(f"the model cannot run from token ids alone: its forward raised {refusal}") from None
        refusal = own_refusal(model, ids, lambda m: model_loss(m, ids)) if backward else None
        if refusal is not None:  # adapt traces in eval mode, dropout off, so that the inventory is deterministic
            raise ModelCannotRun(f"the model cannot be traced in eval mode: its backward raised {refusal}") from None
        raise
    finally:
        for param, grad in saved_grads.items():
            param.grad = grad
    return OpInventory(
        ops=sorted(records.values(), key=lambda r: (r.phase, r.module, r.overload)),
        modules=modules,
        tracer="TorchDispatchMode (post-autograd ATen, forward+backward)"
        if backward
        else "TorchDispatchMode (forward)",
        device=str(device.type),
        with_backward=backward,
        input_shape=list(ids.shape),
        seconds=time.perf_counter() - start,
        captured=captured,
    )


def trace_callable(module: nn.Module, *inputs: torch.Tensor, backward: bool = True) -> OpInventory:
    """Inventory of any module called on ``inputs`` (loss: mean square of its first output)."""
    start = time.perf_counter()

    def run(m: nn.Module) -> torch.Tensor:
        out = m(*inputs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.float().pow(2).mean()

    records, modules, captured = trace_ops(module, run, backward=backward, capture=True)
    return OpInventory(
        ops=sorted(records.values(), key=lambda r: (r.phase, r.module, r.overload)),
        modules=modules,
        tracer="TorchDispatchMode (post-autograd ATen)",
        device=inputs[0].device.type,
        with_backward=backward,
        input_shape=list(inputs[0].shape),
        seconds=time.perf_counter() - start,
        captured=captured,
    )
