"""Fused linear + cross-entropy: the ``[tokens, vocab]`` logits are never materialised.

Tokens are processed in chunks. For each chunk the logits are produced by one cuBLAS GEMM into a
reused buffer; a Triton kernel then makes one online-softmax pass (max, log-sum-exp, the label's
logit and, for label smoothing, the logit sum) and a second pass that overwrites the logits with
their gradient in place. Two more GEMMs turn that gradient into this chunk's slice of ``d hidden``
and accumulate ``d weight``, so the backward pass is only a scale by the incoming gradient.
The chunk holds at least ``CHUNK_BUDGET_BYTES`` of logits, and at least as many as ``d weight`` has entries
(``hidden`` rows): every chunk rewrites the whole ``d weight`` in its accumulating GEMM, so small chunks (Liger-Kernel
keeps the logits about the size of the hidden states, 128 rows for a 128k vocabulary at width 2048) spend more time
re-reading ``d weight`` than computing, and run their GEMMs at a skinny, inefficient shape.  ``reduction="none"`` cannot pre-scale per token, so it
recomputes the chunks in backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._registration import launch
from ._utils import next_pow2

REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _softcapped(z, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        e = tl.exp(-2.0 * tl.abs(z) / softcap)  # tanh(|z|/cap) without overflow
        t = (1.0 - e) / (1.0 + e)
        z = softcap * tl.where(z < 0, -t, t)
    return z


@triton.jit
def _ce_chunk_kernel(
    LOGITS,
    stride_l,
    LABELS,
    LOSS,
    SCALE,
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    PER_ROW_SCALE: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    logits = LOGITS + row.to(tl.int64) * stride_l
    label = tl.load(LABELS + row)
    cols = tl.arange(0, BLOCK_V)
    if label == ignore_index:
        tl.store(LOSS + row, 0.0)
        if COMPUTE_GRAD:
            for start in range(0, V, BLOCK_V):
                tl.store(
                    logits + start + cols,
                    tl.zeros([BLOCK_V], tl.float32).to(LOGITS.dtype.element_ty),
                    mask=start + cols < V,
                )
        return
    running_max = -float("inf")
    running_sum = 0.0
    logit_sum = 0.0
    # each pass prefetches block i+1 before reducing block i: twice the bytes in flight per program
    raw_next = tl.load(logits + cols, mask=cols < V, other=0.0)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        raw = raw_next
        raw_next = tl.load(logits + start + BLOCK_V + cols, mask=start + BLOCK_V + cols < V, other=0.0)
        z = _softcapped(raw.to(tl.float32), softcap, HAS_SOFTCAP)
        z = tl.where(mask, z, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
        logit_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
    lse = running_max + tl.log(running_sum)
    label_logit = _softcapped(tl.load(logits + label).to(tl.float32), softcap, HAS_SOFTCAP)
    loss = (1.0 - label_smoothing) * (lse - label_logit) + label_smoothing * (lse - logit_sum / V)
    tl.store(LOSS + row, loss + z_loss * lse * lse)
    if COMPUTE_GRAD:
        if PER_ROW_SCALE:
            scale = tl.load(SCALE + row)
        else:
            scale = tl.load(SCALE)
        prob_scale = 1.0 + 2.0 * z_loss * lse  # d(z_loss * lse^2)/dz = 2 z_loss lse softmax
        raw_next = tl.load(logits + cols, mask=cols < V, other=0.0)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            mask = idx < V
            raw = raw_next
            raw_next = tl.load(logits + idx + BLOCK_V, mask=idx + BLOCK_V < V, other=0.0)
            z = _softcapped(raw.to(tl.float32), softcap, HAS_SOFTCAP)
            grad = tl.exp(z - lse) * prob_scale - label_smoothing / V
            grad = tl.where(idx == label, grad - (1.0 - label_smoothing), grad)
            if HAS_SOFTCAP:
                grad = grad * (1.0 - (z / softcap) * (z / softcap))
            tl.store(logits + idx, (grad * scale).to(LOGITS.dtype.element_ty), mask=mask)


CHUNK_BUDGET_BYTES = 256 * 2**20  # transient logits per chunk: 1024 rows of a 128k bf16 vocabulary
CHUNK_ROW_MULTIPLE = 128  # GEMM tile height: a chunk of whole tiles


def default_chunk_size(tokens: int, hidden: int, vocab: int, element_bytes: int = 2) -> int:
    """Rows per chunk: logits of ``max(CHUNK_BUDGET_BYTES, the hidden states' size, d weight's size)``, in whole
    GEMM tiles.  A chunk of ``hidden`` rows holds as many logits as d weight has entries, so the accumulating GEMM
    re-reads d weight at most once per its own operand's bytes: on an H200 the head's GEMMs ran at 0.98-1.0 of
    their unchunked time from there, against 1.06 (Llama-3.2-1B) and 1.14 (Gemma-2-2B) at 256 MiB chunks
    (``benchmarks/results/flce-chunks-h200.md``)."""
    budget = max(CHUNK_BUDGET_BYTES, tokens * hidden * element_bytes, hidden * vocab * element_bytes)
    rows = max(1, budget // (vocab * element_bytes))
    if rows >= CHUNK_ROW_MULTIPLE:
        rows -= rows % CHUNK_ROW_MULTIPLE
    return min(tokens, rows)


def run_chunks(hidden, weight, bias, labels, scale, opts, *, need_grad, need_dh, need_dw, need_db):
    """One pass over all token chunks: per-token losses and, if asked, the scaled gradients."""
    tokens, width = hidden.shape
    vocab = weight.shape[0]
    chunk = opts["chunk_size"] or default_chunk_size(tokens, width, vocab, hidden.element_size())
    logits_dtype = hidden.dtype
    buffer = torch.empty((min(chunk, tokens), vocab), dtype=logits_dtype, device=hidden.device)
    losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_dh else None
    dw = torch.empty_like(weight) if need_dw and tokens else (torch.zeros_like(weight) if need_dw else None)
    # (the first chunk writes dw with a plain GEMM, later chunks accumulate into it)
    db = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if need_db else None
    block_v = min(8192, next_pow2(vocab))
    weight_t = weight.t()
    for start in range(0, tokens, chunk):
        stop = min(start + chunk, tokens)
        h = hidden[start:stop]
        logits = buffer[: stop - start]
        if bias is not None:
            torch.addmm(bias.to(logits_dtype), h, weight_t, out=logits)
        else:
            torch.mm(h, weight_t, out=logits)
        chunk_scale = scale[start:stop] if opts["per_row_scale"] else scale
        launch(_ce_chunk_kernel)[(stop - start,)](
            logits,
            logits.stride(0),
            labels[start:stop],
            losses[start:stop],
            chunk_scale,
            vocab,
            opts["ignore_index"],
            opts["label_smoothing"],
            opts["z_loss"],
            opts["softcap"] or 1.0,
            HAS_SOFTCAP=opts["softcap"] is not None,
            PER_ROW_SCALE=opts["per_row_scale"],
            COMPUTE_GRAD=need_grad,
            BLOCK_V=block_v,
            num_warps=16 if block_v >= 8192 else 4,
        )
        if need_dh:
            torch.mm(logits, weight, out=dh[start:stop])
        if need_dw and start == 0:
            torch.mm(logits.t(), h, out=dw)
        elif need_dw:
            dw.addmm_(logits.t(), h)  # fp32 accumulation inside the GEMM, one rounding per chunk
        if need_db:
            db += logits.sum(0, dtype=torch.float32)
    return losses, dh, dw, db
