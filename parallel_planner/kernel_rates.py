"""What one kernel of a block costs on one GPU: GEMMs (ceiling, waves, fp8 recipes), attention (flash kernels'
measured rates, unfused scores, dropout, score bias), and the bytes-bound passes (hidden dropout, fp8 casts, the loss).

``timing.step_time`` composes these into a step; ``docs/planner-model.md`` states each constant's source.
"""

from __future__ import annotations

import numpy as np

from parallel_planner.cluster import Cluster
from parallel_planner.efficiency import FP8_SCALINGS, Efficiency
from parallel_planner.memory import ACT_BYTES
from parallel_planner.profile import BlockProfile
from parallel_planner.runtimes import CROSS_ENTROPY_BYTES
from parallel_planner.workload import Workload

# Streaming multiprocessors (CUs on MI300X): a GEMM's output tiles run in waves of this many (datasheets).
SM_COUNT = {"a100": 108, "h100": 132, "h800": 132, "h200": 132, "b200": 148, "mi300x": 304}
GEMM_TILE = (128, 256)  # output tile of the vendor BLAS's large bf16 kernels (cuBLAS/CUTLASS Hopper default)
# Fraction of dense bf16 peak that flash attention sustains over forward + backward (causal, head dim 128).
# FlashAttention-2: its paper on A100 (Dao 2023, Fig. 4-7: ~170-190 TFLOP/s forward + backward).  On GH100 measured:
# torch's flash backend (FlashAttention-2) at Megatron-Core's attention shape ran forward + backward at 260 TFLOP/s on
# the H200, forward alone 308 (benchmarks/results/attention-dropout-h200.md, torch 2.11), 0.263 of peak; the 0.34
# taken before from the FlashAttention-3 paper's ~330-350 for FA2 on H100 matched the forward.  The FlashAttention-3
# / cuDNN class on GH100 (H100, H800, H200: one die, one clock envelope): measured, cuDNN's causal SDPA at
# Megatron-Core's attention shape (batch 4, 16 heads of 128, seq 4096) ran forward + backward at 477 TFLOP/s on the
# H200 (forward alone 595; benchmarks/results/gemm-shapes-h200.md), 0.48 of peak.  The FA3 paper's 550-600 are forward figures; its
# backward runs slower, as cuDNN's does (about 440 here).
ATTENTION_FRACTION = {
    "flash2": {"a100": 0.58, "h100": 0.263, "h800": 0.263, "h200": 0.263, "b200": 0.30, "mi300x": 0.30},
    "flash3": {"a100": 0.58, "h100": 0.48, "h800": 0.48, "h200": 0.48, "b200": 0.50, "mi300x": 0.35},
}
# The same kernels at head dim 64 on GH100, where the rate per FLOP falls: a score costs the same exponential at
# any head dim while its matmul FLOPs halve, and GH100 has 989 TFLOP/s of bf16 matmul but 3.9 TFLOP/s of
# exponentials (FlashAttention-3 paper, Shah et al. 2024, sec. 3.1: at head dim 128 the exponentials take half the
# matmul cycles; at 64 as many).  Measured by adapt's operators stage on the H200 (torch 2.11; causal SDPA forward +
# backward, batch 4, 32 heads of 64, seq 2048; benchmarks/results/e2e-h200.md "Timed kernel choices"): cuDNN
# 0.858 ms, flash 1.255 ms, i.e. 280 and 192 TFLOP/s counting the causal FLOPs as attention_seconds does (forward
# 4 x heads x 64 x tokens x (seq+1)/2, backward 2.5x): 0.283 and 0.194 of peak, against 0.48 and 0.263 at head
# dim 128 (0.59 and 0.74 of them; exponentials and matmuls run without overlap would give 0.75).  Other GPUs have no
# measurement at 64 and keep their head-dim-128 figure.
ATTENTION_FRACTION_HEAD_DIM_64 = {
    "flash2": {"h100": 0.194, "h800": 0.194, "h200": 0.194},
    "flash3": {"h100": 0.283, "h800": 0.283, "h200": 0.283},
}
ATTENTION_KERNELS = ("flash2", "flash3", "unfused")
DROPOUT_BYTES = 5  # per attention score and pass: fp16 read and write, 1-byte mask written (read in backward)
# Flash kernels drop in-kernel, drawing a random number per score in the forward and again in the backward: the
# rate with dropout 0.1 over the rate without it, (forward, backward), measured at Megatron-Core's attention shapes
# (head dim 128, seq 4096, batch 1-4, 12-16 heads; benchmarks/results/attention-dropout-h200.md, torch 2.11 on the
# H200).  flash3: cuDNN's fused attention, the kernel of that class that drops (FlashAttention-3 has no dropout, so
# Transformer Engine runs cuDNN's when dropout is on): 0.47 forward, 0.83 backward.  flash2: FlashAttention-2 (torch's
# flash backend): 0.82 and 0.90.  Read for every GPU: the cost is the kernel's Philox draws, not the die.
FLASH_DROPOUT_RATE = {"flash2": (0.82, 0.90), "flash3": (0.47, 0.83)}
# An fp8 GEMM's rate over the bf16 GEMM's at the same shape, as a share of the 2x their peaks promise, by scaling
# recipe: one scale per tensor (Transformer Engine's delayed scaling), per row, or DeepSeek-V3's blocks (1x128
# activation tiles x 128x128 weight blocks).  Medians over 8 shapes (8192^3 and DeepSeek-V3's expert and attention
# GEMMs in forward, input- and weight-gradient orientation) of torch's scaled_mm on the H200, torch 2.11:
# benchmarks/results/fp8-gemm-h200.md (blockwise 998-1323 TFLOP/s, 0.50-0.67 of the fp8 peak).
FP8_SCALING_RATE = {"tensorwise": 0.90, "rowwise": 0.88, "blockwise": 0.81}
assert tuple(FP8_SCALING_RATE) == FP8_SCALINGS
# An fp8 recipe casts each GEMM's operands: forward, the input row-wise (read 2 bytes, write 1); backward, the output
# gradient row-wise for the input-gradient GEMM and column-wise for the weight-gradient GEMM, and the input
# column-wise (from its cached copy).  Row-wise casts run at the elementwise rate (the compiled 1x128-tile cast
# reached 0.91 of a device copy on the H200); a column-wise cast transposes as it goes and ran at 0.34 of a copy at
# best (8192 x 7168; 0.18 at widths 2048 and 4096): 0.37 of the elementwise rate (fp8-gemm-h200.md).
FP8_CAST_BYTES = 3  # per element cast: 2 read, 1 written (the 4-byte scale per 128 elements is 3 % more)
FP8_TRANSPOSED_CAST_RATE = 0.37
# Hidden dropout (Megatron's bias-dropout-add after attention and after the MLP): the forward writes a 1-byte mask
# beside the sum, the backward reads the gradient and the mask and writes the branch's gradient (2 + 1 + 2), where
# without dropout the gradient passes through untouched.  Bytes per element of one residual branch, (fwd, bwd).
HIDDEN_DROPOUT_BYTES = (1, 5)
# An additive score bias (ALiBi) handed to the unfused scores GEMM as its input (baddbmm, beta != 0): broadcast into
# the output first (2 bytes written per score), then read by the GEMM (2), in every forward pass.
SCORE_BIAS_BYTES = 4


def attention_fraction(kernel: str, gpu: str, head_dim: int = 128) -> float:
    """Fraction of dense bf16 peak a flash kernel sustains forward + backward: its head-dim-64 measurement for
    heads of 64 or fewer where there is one, else its head-dim-128 figure (0.3 for a GPU without one)."""
    if 0 < head_dim <= 64 and gpu in ATTENTION_FRACTION_HEAD_DIM_64.get(kernel, {}):
        return ATTENTION_FRACTION_HEAD_DIM_64[kernel][gpu]
    return ATTENTION_FRACTION[kernel].get(gpu, 0.3)


def elementwise_bytes_per_s(cluster: Cluster, eff: Efficiency) -> float:
    """The rate of a bytes-bound pass: the HBM datasheet at the achieved elementwise fraction."""
    return cluster.gpu.hbm_gbps * 1e9 * eff.memory_bw


def routed_rows(block: BlockProfile, tokens, ep, imbalance):
    """Rows the busiest EP rank's experts process for ``tokens`` local tokens: every routed copy, times the
    imbalance when experts are spread over ranks (one rank holding all of them has none to suffer)."""
    return tokens * block.top_k * np.where(ep > 1, imbalance, 1.0)


def slowest_gpu_pace(num_gpus: int, spread: float) -> float:
    """Compute-time multiplier of a synchronous step on ``num_gpus`` GPUs, which waits for its slowest GPU.

    Chips of one SKU run at different speeds under power management; speeds spread uniformly over ``spread``
    of the median around it, so the slowest of ``n`` runs at ``1 - spread/2 + spread/(n+1)`` of the median in
    expectation.  One GPU is the median: the catalogue's and a calibration's rates are single-GPU readings.
    """
    return 1.0 / (1.0 - spread / 2 + spread / (num_gpus + 1))


def gemm_peak(cluster: Cluster, precision: str, eff: Efficiency) -> float:
    """The dense peak a block's GEMMs run against: fp8 at its recipe's measured share (``FP8_SCALING_RATE``)."""
    peak = cluster.gpu.peak_flops(precision)
    return peak * FP8_SCALING_RATE[eff.fp8_scaling] if precision == "fp8" else peak


def wave_efficiency(m, n, gpu: str):
    """Useful fraction of the last wave of output tiles: ``tiles / (waves * SMs)``."""
    sms = SM_COUNT.get(gpu, 132)
    tiles = np.ceil(np.maximum(m, 1) / GEMM_TILE[0]) * np.ceil(np.maximum(n, 1) / GEMM_TILE[1])
    return tiles / (np.ceil(tiles / sms) * sms)


def gemm_seconds(m, k, n, cluster: Cluster, peak: float, eff: Efficiency, count=1.0):
    """``count`` GEMMs of ``(m x k) @ (k x n)`` issued as one grouped kernel: the large-GEMM ceiling the
    catalogue measured, less the idle SMs of a partial last wave, or HBM-bound when skinny."""
    flops = 2.0 * m * k * n
    moved = ACT_BYTES * (m * k + k * n + m * n)
    rate = peak * cluster.gpu.gemm_ceiling * eff.gemm_scale * wave_efficiency(m * count, n, cluster.gpu.name)
    hbm = elementwise_bytes_per_s(cluster, eff)
    return count * np.maximum(flops / rate, moved / hbm) + eff.kernel_overhead_s


def attention_seconds(block: BlockProfile, tokens, tp, context: float, seq_len: int, cluster: Cluster, eff: Efficiency):
    """Forward seconds of the attention kernel for ``tokens`` local tokens.

    Flash kernels run at their measured fraction of peak (``attention_fraction``: by head dim) on the causal
    FLOPs.  Unfused attention (Megatron-LM 2021: batched GEMMs and a fused softmax) multiplies the whole square at
    the GEMM rate and streams the fp16 scores through HBM: written, read and written by the softmax, read by the
    second GEMM.
    """
    bf16_peak = cluster.gpu.peak_flops("bf16")
    flops = tokens * context * block.attention_flops_per_ctx / tp
    if eff.attention != "unfused":
        return flops / (bf16_peak * attention_fraction(eff.attention, cluster.gpu.name, block.head_dim))
    square = tokens * seq_len * block.attention_flops_per_ctx / tp
    scores = 4 * ACT_BYTES * tokens * seq_len * block.num_heads / tp
    return square / (bf16_peak * cluster.gpu.gemm_ceiling * eff.gemm_scale) + scores / (
        elementwise_bytes_per_s(cluster, eff)
    )


def attention_dropout_seconds(
    block: BlockProfile, tokens, tp, seq_len: int, cluster: Cluster, eff: Efficiency, attention=0.0
) -> tuple:
    """(forward, backward) seconds attention dropout adds to one pass.  Unfused kernels run it as a kernel of its
    own that reads the fp16 probabilities and writes them with a 1-byte mask (5 bytes per score), and in backward
    reads the gradient and the mask and writes (5).  Flash kernels drop in-kernel, on scores that never reach HBM,
    at the rate ``FLASH_DROPOUT_RATE`` measured: ``attention`` is the kernel's forward seconds without dropout."""
    if not eff.attention_dropout or not block.has_attention:
        return 0.0, 0.0
    if eff.attention != "unfused":
        forward_rate, backward_rate = FLASH_DROPOUT_RATE[eff.attention]
        return attention * (1 / forward_rate - 1), 2.5 * attention * (1 / backward_rate - 1)
    scores = tokens * seq_len * block.num_heads / tp
    seconds = DROPOUT_BYTES * scores / (elementwise_bytes_per_s(cluster, eff))
    return seconds, seconds


def hidden_dropout_seconds(block: BlockProfile, tokens, tp, sp, cluster: Cluster, eff: Efficiency) -> tuple:
    """(forward, backward) seconds hidden dropout adds to one pass: ``HIDDEN_DROPOUT_BYTES`` per element of each
    residual branch (attention, MLP), on the whole activation of every TP rank unless sequence parallel splits it."""
    if not eff.hidden_dropout:
        return 0.0, 0.0
    split = np.where(np.asarray(sp) > 0, tp, 1) if sp is not None else 1
    elements = block.residual_branches * tokens * block.hidden / split
    per_byte = elements / (elementwise_bytes_per_s(cluster, eff))
    return HIDDEN_DROPOUT_BYTES[0] * per_byte, HIDDEN_DROPOUT_BYTES[1] * per_byte


def score_bias_seconds(block: BlockProfile, tokens, tp, seq_len: int, cluster: Cluster, eff: Efficiency):
    """Seconds one forward pass spends materialising an additive score bias (ALiBi) for the unfused scores
    GEMM: Megatron-DeepSpeed passes it as baddbmm's input, which is broadcast into the output and read back
    (``SCORE_BIAS_BYTES`` per score).  Backward does not touch it; flash kernels add it in-kernel."""
    if eff.attention != "unfused" or not block.score_bias or not block.has_attention:
        return 0.0
    scores = tokens * seq_len * block.num_heads / tp
    return SCORE_BIAS_BYTES * scores / (elementwise_bytes_per_s(cluster, eff))


def loss_seconds(tokens, vocab: int, tp, cluster: Cluster, eff: Efficiency):
    """(forward, backward) HBM seconds of the cross-entropy loss over ``tokens`` local tokens' logits, split over
    TP: the runtime's bytes per logit (``runtimes.CROSS_ENTROPY_BYTES``; Megatron's fp32 vocab-parallel loss)."""
    per_byte = tokens * vocab / tp / (elementwise_bytes_per_s(cluster, eff))
    forward, backward = CROSS_ENTROPY_BYTES[eff.runtime]
    return forward * per_byte, backward * per_byte


def fp8_cast_seconds(block: BlockProfile, tokens, tp, ep, cluster: Cluster, workload: Workload, eff: Efficiency):
    """(forward, backward) seconds of an fp8 recipe's casts around the block's GEMMs (``FP8_CAST_BYTES`` per element):
    forward the input row-wise, backward the output gradient row-wise and column-wise and the input column-wise
    from its cached copy (1 byte read when activations are cached in fp8, else 2).  Routed experts cast at the
    busiest EP rank's tokens; with fp8 dispatch their first input was cast once per token before it left."""
    if workload.precision != "fp8":
        return 0.0, 0.0
    hbm = elementwise_bytes_per_s(cluster, eff)
    cached = 1 if workload.act_cache_bits == 8 else 2
    forward = backward = 0.0
    for g in block.gemms:
        k, n = g.per_rank(tp)
        rows = routed_rows(block, tokens, ep, workload.moe_imbalance) if g.routed else tokens
        cast_in = tokens if g.routed and eff.ep_fp8_dispatch and g.in_features == block.hidden else rows
        forward = forward + FP8_CAST_BYTES * cast_in * k / hbm
        transposed = rows * (FP8_CAST_BYTES * n + (cached + 1) * k) / (hbm * FP8_TRANSPOSED_CAST_RATE)
        backward = backward + FP8_CAST_BYTES * rows * n / hbm + transposed
    return forward, backward
