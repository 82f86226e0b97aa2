"""Host cost of issuing one operator: eager, DTensor and compiled dispatch, measured on this torch build.

The time model charges every kernel a step launches with the CPU time it takes to issue it.  A layout
whose issue time exceeds its GPU time is host-bound: the GPU waits for the CPU.  The cost depends on
how the runtime dispatches: plain eager tensors (Python module code, the dispatcher, autograd
bookkeeping), DTensor (sharding propagation on every op; tensor parallelism in torch's own style) or
a compiled graph (one launch per fused kernel).

``measure_dispatch_costs`` is the microbenchmark the environment stage runs: a forward and backward
of a small chain of linear and elementwise ops on tensors so small that the device finishes each kernel
before the host has issued the next, so wall time is host time.  It counts the aten operators the chain
runs (forward and backward, through a dispatch mode) and divides.  The result is a ``DispatchCosts``
that ``calibration`` files carry and ``timing`` uses.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class DispatchCosts:
    """Seconds of host time per aten operator (forward or backward) under each dispatch mode.

    The defaults were measured with ``measure_dispatch_costs("cpu")`` on the 2-core build machine
    (torch 2.13, an x86 server core under shared load; see docs/planner-model.md).  A GPU host's own
    figures replace them through a calibration file (``dispatch`` section).
    """

    eager_s: float = 18.6e-6  # transformers Llama layers, eager forward + backward, per aten op
    dtensor_s: float = 78e-6  # the same plus DTensor's own ~60 us per op (propagation and wrapping)
    compiled_s: float = 4e-6  # not measured here: one launch per fused kernel (CUDA's launch cost)
    source: str = "build-machine microbenchmark (docs/planner-model.md)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _chain(torch, x, weights):
    """Linear, norm, activation and residual ops: the mix a decoder block issues."""
    h = x
    for w in weights:
        y = torch.nn.functional.linear(h, w)
        y = torch.nn.functional.silu(y) * y
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = h + y
    return h.sum()


def _decoder_layer_seconds_per_op(torch, device: str, repeats: int) -> float:
    """Host seconds per aten op of a tiny transformers Llama (module code, autograd, dispatch), forward and
    backward with the loss: its layers issue most of the ops, as in a real model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = torch.randint(0, 128, (1, 16), device=device)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=4, vocab_size=128, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    return _seconds_per_call(torch, step, device, repeats) / _count_ops(torch, step)


def _count_ops(torch, fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.calls += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.calls


def _seconds_per_call(torch, fn, device: str, repeats: int) -> float:
    for _ in range(3):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def measure_dispatch_costs(device: str = "cpu", layers: int = 8, repeats: int = 20, compiled: bool = False
                           ) -> DispatchCosts:
    """Host seconds per aten operator, eager and as DTensor (and compiled when ``compiled``).

    DTensor runs on a one-rank mesh: sharding propagation and the wrapper dispatch are the same per op
    as on a larger mesh, and no second process is needed.  A process group is created for it only when
    none exists, and destroyed again.
    """
    import torch
    import torch.distributed as dist

    width = 16  # tiny: each kernel's device time is far below its issue time
    x = torch.randn(4, width, device=device, requires_grad=True)
    weights = [torch.randn(width, width, device=device, requires_grad=True) for _ in range(layers)]

    def eager_step():
        _chain(torch, x, weights).backward()

    ops = _count_ops(torch, eager_step)
    bare = _seconds_per_call(torch, eager_step, device, repeats) / ops
    eager = _decoder_layer_seconds_per_op(torch, device, repeats)

    created = False
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        created = True
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh(device.split(":")[0], (1,))
        dx = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        dws = [distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_() for w in weights]

        def dtensor_step():
            _chain(torch, dx, dws).backward()

        # DTensor's own cost per op (propagation, wrapping) on top of what the eager module code costs
        dtensor = eager + max(0.0, _seconds_per_call(torch, dtensor_step, device, repeats) / ops - bare)
    finally:
        if created:
            dist.destroy_process_group()

    compiled_s = DispatchCosts.compiled_s
    if compiled:
        step = torch.compile(lambda: _chain(torch, x, weights))

        def compiled_step():
            step().backward()

        compiled_s = _seconds_per_call(torch, compiled_step, device, repeats) / ops
    return DispatchCosts(eager, dtensor, compiled_s, source=f"measure_dispatch_costs({device!r}), torch {torch.__version__}")
