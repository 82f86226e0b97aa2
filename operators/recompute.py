"""Activation recomputation per block: what a block keeps for its backward pass and what it recomputes.

``full`` keeps only the block's inputs and reruns the whole block in backward.  ``selective`` keeps what is
expensive to redo (matmuls, attention, grouped expert GEMMs) and recomputes the memory-bound work around
it: norms, activations, rotary, residual adds, dtype casts, views, routing's gathers.
Under ``torch.compile`` the recomputed ops fuse into the backward kernels that read them, so the saving
(about a third of a dense block's activations) costs one extra write of each recomputed tensor.

The policy names what is kept (compute-bound operators) and reruns the rest: a kept output that a later
in-place op mutated could not be replayed.  Both modes restore the RNG state before they rerun a block,
so recomputed dropout draws the mask the forward pass drew.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import operators.kernels.moe_ops  # noqa: F401 - registers torch.ops.adapt.grouped_gemm

RECOMPUTE_MODES = ("none", "selective", "full")

_aten = torch.ops.aten
# Compute-bound operators: their outputs are worth keeping.  Everything else (norms, activations, rotary,
# residual adds, casts, copies, dropout, routing's gathers) is rerun in backward.
_KEEP = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.adapt.grouped_gemm.default,
}
if hasattr(_aten, "_grouped_mm"):
    _KEEP.add(_aten._grouped_mm.default)


def recomputable(op: Any) -> bool:
    """Whether selective recomputation reruns ``op`` in backward instead of keeping its output."""
    return op not in _KEEP


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """``torch.utils.checkpoint``'s per-op decision for ``selective``."""
    return CheckpointPolicy.PREFER_RECOMPUTE if recomputable(op) else CheckpointPolicy.MUST_SAVE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(selective_policy)


def _without_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The block's arguments less any key/value cache, passed by name or by position (GPT-2's blocks take it
    second).  A rerun block would append its keys and values to the cache a second time, so the rerun would
    differ from the forward pass; and the append is a side effect that ``torch.compile`` cannot keep inside a
    checkpointed region (the whole block then runs eagerly).  A model being trained reads no cache."""
    from transformers.cache_utils import Cache

    args = tuple(None if isinstance(a, Cache) else a for a in args)
    kwargs = {k: (None if isinstance(v, Cache) else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The block's forward under ``torch.utils.checkpoint``.  One function for every block (the block's
    own state says what to run), so a block compiled on its own still shares one graph with its siblings.
    Without gradients (evaluation, generation) nothing is recomputed and the block runs as it is."""
    mode, inner = module.__dict__["_adapt_recompute"]
    if not torch.is_grad_enabled():
        return type(module).forward(module, *args, **kwargs) if inner is None else inner(*args, **kwargs)
    args, kwargs = _without_cache(args, kwargs)
    options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": True}
    if mode == "selective":
        options["context_fn"] = _selective_contexts
    if inner is None:
        return checkpoint(type(module).forward, module, *args, **options, **kwargs)
    return checkpoint(inner, *args, **options, **kwargs)


def checkpoint_blocks(blocks: Iterable[nn.Module], mode: str) -> Callable[[], None]:
    """Make every block in ``blocks`` recompute in backward as ``mode`` says; returns the undo.

    The blocks stay where they are (no wrapper module), so parameter names and state-dict keys do not change.
    Apply it before compiling a block: the compiled graph then carries the recomputation.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, not {mode!r}")
    if mode == "none":
        return lambda: None
    touched = []
    for block in blocks:
        block.__dict__["_adapt_recompute"] = (mode, block.__dict__.get("forward"))  # a patched forward is kept
        block.forward = types.MethodType(_checkpointed_forward, block)
        touched.append(block)
    previous = _allow_side_effects_in_checkpointed_regions(True)
    return functools.partial(_restore, touched, previous)


def _allow_side_effects_in_checkpointed_regions(allow: bool) -> bool:
    """Let Dynamo trace a checkpointed block whose forward mutates Python state; returns the previous setting.

    adapt's rotary patch tells its dispatcher which module runs by pushing on a list and popping it again
    (``operators.providers.triton_rope``).  Dynamo refuses any mutation inside a checkpointed region, because
    eager recomputation would replay it and compiled code cannot, and then runs the whole block eagerly
    (measured on the H200: a selective Llama-1B step 14% slower than the kept one).  A push and its pop
    leave no trace, so replaying them or not is the same; the flag is Dynamo's own switch for that choice.
    """
    config = torch._dynamo.config
    previous = config.skip_fwd_side_effects_in_bwd_under_checkpoint
    config.skip_fwd_side_effects_in_bwd_under_checkpoint = allow
    return previous


def _restore(blocks: list[nn.Module], previous: bool) -> None:
    _allow_side_effects_in_checkpointed_regions(previous)
    for block in blocks:
        _, inner = block.__dict__.pop("_adapt_recompute")
        if inner is None:
            block.__dict__.pop("forward", None)
        else:
            block.forward = inner
