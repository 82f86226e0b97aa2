"""Host cost of issuing one operator: eager, DTensor and compiled dispatch, measured on this torch build.

The time model charges every kernel a step launches with the CPU time it takes to issue it.  A layout
whose issue time exceeds its GPU time is host-bound: the GPU waits for the CPU.  The cost depends on
how the runtime dispatches: plain eager tensors (Python module code, the dispatcher, autograd
bookkeeping), DTensor (sharding propagation on every op; tensor parallelism in torch's own style) or
a compiled graph (one launch per fused kernel).

``measure_dispatch_costs`` is the microbenchmark the environment stage runs: a forward and backward
of a tiny transformers Llama, eager and tensor-parallel, on tensors so small that the device finishes
each kernel before the host has issued the next, so wall time is host time.  It counts the aten
operators the eager model runs (forward and backward, through a dispatch mode) and divides.  The result is a ``DispatchCosts``
that ``calibration`` files carry and ``timing`` uses.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class DispatchCosts:
    """Seconds of host time per aten operator (forward or backward) under each dispatch mode.

    The defaults were measured with ``measure_dispatch_costs("cpu")`` on the 2-core build machine (torch
    2.13): eager at low load; DTensor as the eager figure times the DTensor/eager ratio measured on a 2-rank
    mesh (see docs/planner-model.md).  A GPU host's own figures replace them through a calibration file
    (``dispatch`` section).
    """

    eager_s: float = 18.6e-6  # transformers Llama layers, eager forward + backward, per aten op
    # the same under torch TP + SP on a 2-rank mesh: 7.9x eager (median of 4 runs, 7.1-8.0x; a one-rank mesh, which
    # skips every redistribution, gave 5.5-5.9x, and 110 us was this default until session 23)
    dtensor_s: float = 147e-6
    compiled_s: float = 4e-6  # not measured here: one launch per fused kernel (CUDA's launch cost)
    source: str = "build-machine microbenchmark (docs/planner-model.md)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


MESH_RANKS = 2  # DTensor's host cost is measured on a mesh of this many ranks


def measure_dispatch_costs(device: str = "cpu", repeats: int = 20, compiled: bool = False) -> DispatchCosts:
    """Host seconds per aten operator of transformers' Llama layers: eager, under torch's tensor-parallel
    style (DTensor with sequence parallelism), and compiled when ``compiled``.

    DTensor runs on a mesh of ``MESH_RANKS`` ranks over torch's fake process group: one process issues every
    operator, redistribution and collective a rank of a real mesh issues, and nothing is communicated.  A mesh
    of one rank would not do: it skips the redistributions, and measured 1.36x cheaper per operator on the build
    machine (torch 2.13).  An existing process group is used as it is (its world size is the mesh); one is
    created only when none exists, and destroyed again.  Each mode's wall time is divided by the eager model's
    op count, so the planner multiplies the same op counts by each mode's cost.
    """
    import torch
    import torch.distributed as dist

    model, ids = _tiny_llama(torch, device)
    positions = torch.arange(ids.shape[1], device=device)[None]  # the whole sequence's, not a rank's shard's

    def step():
        model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()

    ops = _count_ops(torch, step)
    eager = _seconds_per_call(torch, step, device, repeats) / ops
    compiled_s = DispatchCosts.compiled_s
    if compiled:
        compiled_step = torch.compile(lambda: model(input_ids=ids, labels=ids).loss)
        compiled_s = _seconds_per_call(torch, lambda: compiled_step().backward(), device, repeats) / ops

    created = False
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=MESH_RANKS)
        created = True
    try:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        _tensor_parallel(model, init_device_mesh(device.split(":")[0], (world,)))
        dtensor = _seconds_per_call(torch, step, device, repeats) / ops
    finally:
        if created:
            dist.destroy_process_group()
    return DispatchCosts(
        eager,
        dtensor,
        compiled_s,
        source=f"measure_dispatch_costs({device!r}), torch {torch.__version__}, DTensor on {world} ranks",
    )


def _tiny_llama(torch, device: str):
    """A 4-layer Llama small enough that every kernel's device time is far below its issue time."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=128,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(device), torch.randint(0, 128, (1, 16), device=device)


def _tensor_parallel(model, mesh) -> None:
    """Megatron-style TP with sequence parallelism, as torch's tensor-parallel API expresses it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    to_replicated = dict(
        input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
    )
    for layer in model.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(**to_replicated),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    parallelize_module(
        model.model,
        mesh,
        {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
        },
    )
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
