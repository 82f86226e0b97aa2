"""Context parallelism: PyTorch's ring attention for SDPA, sequences sharded over the ``cp`` mesh.

``torch.distributed.tensor.experimental.context_parallel`` shards the listed buffers along the
sequence dimension (load-balanced: rank r holds chunks r and 2*cp-1-r, so causal work is even)
and swaps SDPA for ring attention inside the context.  Position ids are passed explicitly and
sharded with the tokens, so rotary embeddings see each token's true position; an all-ones
attention mask goes with them, because HF reads non-consecutive position ids without a mask as
packed sequences and would build a block mask (ring attention needs plain causal SDPA).  The ring kernels
are the CUDA flash / memory-efficient SDPA paths: on any other device this raises ``BadInput``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh

from adapt.core.errors import BadInput


def check_context_parallel(device: torch.device, attn_implementation: str | None) -> None:
    if device.type != "cuda":
        raise BadInput("context parallelism needs CUDA: PyTorch's ring attention runs on the CUDA SDPA kernels only")
    if attn_implementation not in (None, "sdpa"):
        raise BadInput(f"context parallelism needs SDPA attention, the model uses {attn_implementation!r}")


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    batch, seq = input_ids.shape
    return torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq).contiguous()


@contextlib.contextmanager
def context_parallel_batch(cp_mesh: DeviceMesh, buffers: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Shard ``buffers`` (``[batch, seq, ...]``) along the sequence in place for the duration of the block."""
    from torch.distributed.tensor.experimental import context_parallel

    if any(b.shape[1] % (2 * cp_mesh.size()) for b in buffers):
        raise BadInput(
            f"sequence length must be a multiple of 2*cp={2 * cp_mesh.size()} for load-balanced context parallelism"
        )
    with context_parallel(
        cp_mesh,
        buffers=buffers,
        buffer_seq_dims=[1] * len(buffers),
        no_restore_buffers=set(buffers),
    ):
        yield buffers
