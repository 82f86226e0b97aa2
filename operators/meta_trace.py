"""Shape-only inventory of config-only giants: one block per distinct structure, on meta tensors.

No weights are allocated: the model is built on the meta device, every op runs through meta
kernels, and blocks that repeat an already-traced structure are swapped for a pass-through for the
duration of the trace, so the cost does not grow with depth (DeepSeek-V3's 61 layers trace as 2).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from adapt.model.blocks import NoBlockList, find_blocks
from operators.dispatch_trace import trace_ops
from operators.inventory import OpInventory, example_batch


def block_signature(block: nn.Module) -> tuple:
    """Structure of a block: parameter names, shapes and dtypes (blocks sharing it trace identically)."""
    return tuple(sorted((n, tuple(p.shape), str(p.dtype)) for n, p in block.named_parameters()))


def _passthrough(reference_output: list[Any]):
    """A stand-in block forward that returns its hidden-state input in the real block's output structure."""

    def forward(*args, **kwargs):
        hidden = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        out = reference_output[0]
        if isinstance(out, tuple):
            return (hidden, *out[1:])
        return hidden

    return forward


def trace_meta_model(model: nn.Module, *, seq_len: int = 16, batch: int = 1) -> OpInventory:
    """Shape-only inventory of a model whose parameters live on the meta device (no weights allocated).

    One block of each distinct structure runs for real at full width; the other blocks are replaced
    for the duration of the trace by a pass-through, so the cost is independent of depth.
    """
    start = time.perf_counter()
    model.to(torch.bfloat16)  # free on meta; grouped-GEMM meta kernels only accept 16-bit inputs
    try:
        blocks = find_blocks(model).named()
    except NoBlockList:
        blocks = []  # no repeated blocks: the whole model is traced once
    representatives: dict[tuple, str] = {}
    patched: list[nn.Module] = []
    first_output: list[Any] = []

    def keep_first_output(module, args, output):
        if not first_output:
            first_output.append(output)

    hook = blocks[0][1].register_forward_hook(keep_first_output) if blocks else None
    try:
        for path, block in blocks:
            signature = block_signature(block)
            if signature in representatives:
                block.forward = _passthrough(first_output)
                patched.append(block)
            else:
                representatives[signature] = path
        ids = example_batch(model, batch, seq_len, device="meta")
        records, modules, _ = trace_ops(model, lambda m: _meta_forward(m, ids), backward=False)
    finally:
        if hook is not None:
            hook.remove()
        for block in patched:
            del block.forward
    skipped = {p for p, _ in blocks} - set(representatives.values())
    modules = {k: v for k, v in modules.items() if not any(k == s or k.startswith(s + ".") for s in skipped)}
    return OpInventory(
        ops=sorted(records.values(), key=lambda r: (r.phase, r.module, r.overload)),
        modules=modules,
        tracer="TorchDispatchMode on meta tensors (forward, one block per distinct structure)",
        device="meta",
        with_backward=False,
        input_shape=[batch, seq_len],
        seconds=time.perf_counter() - start,
        traced_blocks=list(representatives.values()),
    )


def _meta_forward(model: nn.Module, ids: torch.Tensor) -> Any:
    return model(input_ids=ids)
