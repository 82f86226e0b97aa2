"""AdamW over a list of parameter tensors, each streamed once.

The update reads parameter, gradient and both moments once and writes parameter and moments once, in their
storage dtypes, with fp32 arithmetic in registers: 14 bytes per bf16 parameter and nothing else.  It follows the
decoupled-decay form of ``torch.optim.AdamW`` (and the order of operations of its fused CUDA kernel), so the two
are interchangeable step for step and share one ``state_dict`` layout.

One launch per tensor, with the tensors' own pointers as arguments, so Triton sees their alignment.  One launch over
all tensors through a table of pointers read inside the kernel ran 3-5 times slower on the H200 (44 ms a step for
Qwen3-MoE's update against 8.5 ms per tensor; most likely narrow loads for want of a known alignment).  The
launches are issued from one operator call, so the host pays a Triton launch per tensor (about 46 us: 6.7 ms for
Llama-1B's 146 tensors) and one dispatch per step.  On the H200 torch's fused kernel moved these bytes at about
2.7 TB/s and this one at 3.8 TB/s (``benchmarks/results/optimizer-step-h200.md``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import cdiv, check_float

BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _adamw_kernel(P, G, M, V, n, beta1, beta2, eps, decay_factor, step_size, inv_sqrt_bc2, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * decay_factor
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) * inv_sqrt_bc2 + eps
    p = p - step_size * (m / denom)
    tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
    tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)
    tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)


def _check(params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps):
        raise ValueError("params, grads, moments and steps must be lists of one length")
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        check_float("param", p)
        for name, t in (("param", p), ("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
            if t.shape != p.shape or not t.is_contiguous() or t.device != p.device:
                raise ValueError(f"{name} must be contiguous and shaped like its parameter {tuple(p.shape)}")
        if step < 1:
            raise ValueError(f"AdamW steps count from 1, got {step}")


def adamw_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """Update every parameter and its moments in place for its AdamW step number (from 1)."""
    _check(params, grads, exp_avgs, exp_avg_sqs, steps)
    decay_factor = 1.0 - lr * weight_decay
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        n = p.numel()
        if n == 0:
            continue
        step_size, inv_sqrt_bc2 = lr / (1.0 - beta1**step), (1.0 - beta2**step) ** -0.5
        _adamw_kernel[(cdiv(n, BLOCK),)](
            p, g, m, v, n, beta1, beta2, eps, decay_factor, step_size, inv_sqrt_bc2, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
