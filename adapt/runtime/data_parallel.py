"""Data parallelism with FSDP2 ``fully_shard``: per block, then the root.

ZeRO stages map onto FSDP2 as the plan contract states:

* ZeRO-3: ``reshard_after_forward=True``: parameters, gradients and optimizer state sharded.
* ZeRO-2: ``reshard_after_forward=False``: parameters stay gathered between forward and
  backward; gradients and optimizer state sharded.
* ZeRO-1: optimizer state sharded, parameters and gradients kept whole across the step's
  micro-batches.  Realised as ZeRO-2 plus, on every micro-batch but the last, no gradient
  reduce-scatter and no reshard after backward (``set_requires_gradient_sync(False)``,
  ``set_reshard_after_backward(False)``): whole gradients accumulate locally and one
  reduce-scatter + one all-gather per step remain -- ZeRO-1's communication volume.  After the
  last micro-batch FSDP frees the gathered parameters, which ZeRO-1 would keep; the state that
  survives between steps is therefore ZeRO-2-sized, a deliberate trade for using FSDP2 unchanged.
* ZeRO-0: FSDP2 over a 1-wide shard dimension of an HSDP mesh degenerates to replication.

Mixed precision keeps fp32 master weights and optimizer state, computes in bf16 and reduces
gradients in fp32.  CPU offload uses FSDP2's ``CPUOffloadPolicy``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fully_shard(
    model: nn.Module,
    blocks: Iterable[nn.Module],
    dp_mesh: DeviceMesh,
    *,
    zero: int,
    precision: str,
    offload: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """Wrap each block, then the root (embedding, final norm, head) with FSDP2."""
    reshard = zero >= 3
    kwargs = {
        "mesh": dp_mesh,
        "mp_policy": mixed_precision_policy(precision),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
    }
    if ignored_params:
        kwargs["ignored_params"] = ignored_params
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root is all-gathered last in forward and first in backward: never reshard it early.
    fully_shard(model, reshard_after_forward=False, **kwargs)


def set_micro_batch_sync(modules: Iterable[nn.Module], zero: int, last_micro_batch: bool) -> None:
    """ZeRO-1/ZeRO-0 accumulation: skip reduce-scatter and keep parameters gathered until the last micro-batch."""
    if zero > 1:
        return
    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(last_micro_batch, recurse=False)
            module.set_reshard_after_backward(last_micro_batch, recurse=False)
