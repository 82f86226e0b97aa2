"""What each training runtime does around the common time model: pipeline transfers, gradient accumulation and
what its optimizer step adds, read off each framework's source (``docs/planner-model.md`` cites the lines).

``torch``: adapt / torchtitan (FSDP2, DTensor, ``torch.distributed.pipelining``).  ``megatron``: Megatron-LM's
asynchronous pipeline P2P, which sends each stage's output split over TP and all-gathers it on the receiver
(the scatter/gather optimisation, on by default since 2021), and its fp32 main-gradient buffer.
``deepspeed-pipe``: DeepSpeed's ``PipelineEngine`` as Megatron-DeepSpeed ran it in 2022 (BLOOM) with its
``BF16_Optimizer``; the terms below are what its source does that the others do not.
"""

from __future__ import annotations

import numpy as np

DEEPSPEED_PIPE = "deepspeed-pipe"
RUNTIMES = ("torch", "megatron", DEEPSPEED_PIPE)

# Megatron-LM's DDP hook adds each micro-batch's 16-bit gradients into the fp32 main-grad buffer: read 2 + 4, write 4.
MAIN_GRAD_ACCUM_BYTES = 10
# Autograd accumulating a 16-bit gradient into ``.grad`` in place (every micro-batch after the first): read 2 + 2,
# write 2.  Megatron-LM 2021 without contiguous buffers (torch DDP, or local DDP before they became the default).
AUTOGRAD16_ACCUM_BYTES = 6
# DeepSpeed BF16_Optimizer.update_hp_grads after every backward: ``hp_grad.add_(lp.grad.to(fp32))``, the cast
# writes an fp32 temporary (read 2, write 4) that the add reads with the fp32 gradient and writes back (4 + 4 + 4).
DS_BF16_ACCUM_BYTES = 18
# FSDP2 with an fp32 reduce dtype (adapt's and torchtitan's bf16 policy), bytes per parameter it touches
# (``_fsdp_param.py``, ``_fsdp_collectives.py::foreach_reduce``): between reductions the first micro-batch's bf16
# unsharded gradient is upcast (``to_accumulated_grad_if_needed``: read 2, write 4) and every later one added into it
# (``accumulate_unsharded_grad_if_needed``: read 4 + 2, write 4); after a reduction onto a shard that already holds a
# gradient, the fp32 shard is added (``sharded_param.grad._local_tensor += new_sharded_grad``: read 4 + 4, write 4).
FSDP2_UPCAST_BYTES, FSDP2_UNSHARDED_ADD_BYTES, FSDP2_SHARD_ADD_BYTES = 6, 10, 12
# BF16_Optimizer per step over the stage's whole fp32 gradients (not the ZeRO partition): the reduction casts them
# to bf16 (read 4, write 2), averages (2 + 2) and copies back (2 + 4); the global norm reads them (4), clipping
# reads and writes them (8), clear_hp_grads zeroes them (4).
DS_BF16_STEP_BYTES = 32
# PipelineEngine transfers per pass and micro-batch: the activation one way and the gradient the other, each a
# blocking p2p.send/recv of a metadata tensor and the TP partition, one after the other; Megatron and torch
# exchange both directions at once.
DS_TRANSFERS_PER_PASS = 2
DS_MESSAGES_PER_TRANSFER = 2
# All-gathers over TP of a stage's boundary activation per micro-batch: DeepSpeed gathers the received input
# (forward), then restores its partitioned output and gathers the received gradient (backward); Megatron gathers
# the received activation and the received gradient.
TP_GATHERS = {"torch": 0, "megatron": 2, DEEPSPEED_PIPE: 3}
# Loss bytes per logit on the last stage, (forward, backward).  Megatron's vocab-parallel cross entropy (Megatron-LM
# 2021 ``mpu/cross_entropy.py``, which Megatron-DeepSpeed kept, and Megatron-Core r0.8 ``tensor_parallel/
# cross_entropy.py``, unfused by default) upcasts the 16-bit logits (read 2, write 4), takes the max (4), subtracts
# it (4 + 4), exponentiates in place (4 + 4), sums (4) and divides in place (4 + 4): 38; backward scales the saved
# softmax in place (4 + 4) and autograd casts the fp32 gradient back for the head GEMM (4 + 2): 14.  torch: the
# loss reads and writes the logits about three times forward and twice that backward (12, 24).
CROSS_ENTROPY_BYTES = {"torch": (12, 24), "megatron": (38, 14), DEEPSPEED_PIPE: (38, 14)}

# aten operators FSDP2 issues per wrapped group (a block, or the root) and micro-batch, forward + backward, with
# adapt's bf16-parameter / fp32-reduce policy, by (reshard after forward, reduce this micro-batch): the hooks' casts,
# copy-in and copy-out around each all-gather, the reduce-scatter with its copies, the waits.  A micro-batch that does
# not reduce also keeps the parameters unsharded after backward (adapt's ``set_micro_batch_sync`` for ZeRO-0/1,
# ``torch.distributed.pipelining``'s ``backward_maybe_with_nosync``), so the next forward gathers nothing.  Counted
# through a dispatch mode on a live 2- and 4-rank gloo mesh (the same at both; torch 2.13, a tiny Llama wrapped by
# adapt's ``apply_fully_shard``, in steady state): the mean over its blocks and root of the wrapped step's ops less the
# bare model's.
FSDP2_HOST_OPS = {(True, True): 86.0, (True, False): 47.8, (False, True): 69.2, (False, False): 31.0}


def check_runtime(runtime: str) -> str:
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}: one of {', '.join(RUNTIMES)}")
    return runtime


def p2p_seconds(send_recv, nbytes, eff) -> np.ndarray:
    """Seconds of pipeline P2P one micro-batch pays per pass and virtual stage: ``send_recv(nbytes)`` is one
    transfer of the stage's TP partition."""
    if eff.runtime == DEEPSPEED_PIPE:
        meta = send_recv(np.zeros_like(nbytes))  # the small metadata tensor sent before each partition
        return DS_TRANSFERS_PER_PASS * (send_recv(nbytes) + (DS_MESSAGES_PER_TRANSFER - 1) * meta)
    return send_recv(nbytes)


def grad_accum_bytes(eff, m: np.ndarray, zero=0, shard=1, pipelined=False) -> np.ndarray:
    """HBM bytes per local parameter that each micro-batch spends accumulating its weight gradients, the mean over
    the step's ``m`` micro-batches.  torch (FSDP2): ZeRO-2/3 reduce every micro-batch and add each fp32 shard after
    the first; ZeRO-0/1 and pipelined stages keep an fp32 unsharded gradient until the last micro-batch reduces."""
    m = np.asarray(m, dtype=np.float64)
    if eff.runtime == DEEPSPEED_PIPE:
        return np.full_like(m, DS_BF16_ACCUM_BYTES)
    if eff.runtime == "torch":
        every = (np.asarray(zero) >= 2) & ~np.asarray(pipelined, dtype=bool)
        sharded = FSDP2_SHARD_ADD_BYTES * (m - 1) / m / np.asarray(shard, dtype=np.float64)
        unsharded = np.where(m > 1, (FSDP2_UPCAST_BYTES + FSDP2_UNSHARDED_ADD_BYTES * (m - 1)) / m, 0.0)
        return np.where(every, sharded, unsharded)
    if eff.grad_accum_fused:
        return np.zeros_like(m)
    if eff.grads16:
        return AUTOGRAD16_ACCUM_BYTES * (m - 1) / m
    return np.full_like(m, MAIN_GRAD_ACCUM_BYTES)


def grad_reduce_bytes(eff) -> int:
    """Bytes per gradient element the data-parallel reduction sends: 16-bit gradients, or DeepSpeed's bf16
    communication type (its default when bf16 is on and ZeRO off: ``DeepSpeedEngine.communication_data_type``),
    otherwise fp32."""
    return 2 if eff.grads16 or eff.runtime == DEEPSPEED_PIPE else 4


def fsdp2_host_ops(zero, m, pipelined) -> np.ndarray:
    """aten operators FSDP2 issues per wrapped group and micro-batch (``FSDP2_HOST_OPS``), the mean over a step's
    ``m`` micro-batches.  adapt reshards after forward under ZeRO-3 and reduces every micro-batch from ZeRO-2; ZeRO-0/1,
    and any stage under ``torch.distributed.pipelining``, reduce on the last micro-batch only."""
    zero, m = np.asarray(zero), np.asarray(m, dtype=np.float64)
    reshard = zero >= 3
    synced = np.where(reshard, FSDP2_HOST_OPS[True, True], FSDP2_HOST_OPS[False, True])
    unsynced = np.where(reshard, FSDP2_HOST_OPS[True, False], FSDP2_HOST_OPS[False, False])
    every = (zero >= 2) & ~np.asarray(pipelined, dtype=bool)
    return np.where(every, synced, (synced + (m - 1) * unsynced) / m)
