"""FSDP2's own work: the operators its hooks issue per wrapped group and micro-batch, charged to the torch runtime's
host time and recounted on a live 2-rank mesh wrapped the way adapt wraps a model; its fp32 gradient accumulation."""

from __future__ import annotations

import json
import os
import random
import socket
import time

import numpy as np
import pytest

from parallel_planner.dispatch import DispatchCosts
from parallel_planner.efficiency import Efficiency
from parallel_planner.runtimes import (
    FSDP2_HOST_OPS,
    FSDP2_SHARD_ADD_BYTES,
    FSDP2_UNSHARDED_ADD_BYTES,
    FSDP2_UPCAST_BYTES,
    fsdp2_host_ops,
    grad_accum_bytes,
)
from tests.planner.specs import decoder_spec
from tests.planner.test_runtime_terms import run


def test_fsdp2_reduces_every_micro_batch_from_zero2_and_once_a_step_below_or_pipelined():
    m = np.array([1.0, 4.0, 4.0, 4.0, 4.0])
    zero = np.array([3, 3, 2, 1, 3])
    pipelined = np.array([False, False, False, False, True])
    ops = fsdp2_host_ops(zero, m, pipelined)
    assert ops[0] == ops[1] == FSDP2_HOST_OPS[True, True]  # ZeRO-3 reshards after forward and reduces each time
    assert ops[2] == FSDP2_HOST_OPS[False, True]
    assert ops[3] == pytest.approx((FSDP2_HOST_OPS[False, True] + 3 * FSDP2_HOST_OPS[False, False]) / 4)
    assert ops[4] == pytest.approx((FSDP2_HOST_OPS[True, True] + 3 * FSDP2_HOST_OPS[True, False]) / 4)


def test_every_fsdp2_group_adds_its_operators_to_the_host_time_of_a_torch_micro_batch():
    layers = random.choice((4, 8, 16))
    spec = decoder_spec(layers=layers, hidden=1024, heads=16, kv_heads=4)
    host = DispatchCosts(eager_s=random.uniform(5e-6, 3e-5), dtensor_s=random.uniform(5e-5, 2e-4))
    torch_host = run(spec, 2, Efficiency(fused_kernels=False, host=host), dp=2, mbs=2).time_breakdown
    megatron = Efficiency(fused_kernels=False, host=host, runtime="megatron")
    bare = run(spec, 2, megatron, dp=2, mbs=2).time_breakdown  # Megatron has no FSDP2 hooks
    added = (layers + 1) * FSDP2_HOST_OPS[True, True] * host.eager_s  # each block and the root, ZeRO-3
    assert torch_host["host_per_microbatch"] - bare["host_per_microbatch"] == pytest.approx(added, rel=1e-9)


def test_fsdp2_adds_each_reduced_fp32_shard_or_accumulates_the_unsharded_gradient_in_fp32():
    torch_eff = Efficiency()
    m, shard = random.choice((2.0, 4.0, 8.0)), random.choice((1, 2, 8))
    zero = np.array([3, 2, 1, 3])
    pipelined = np.array([False, False, False, True])
    got = grad_accum_bytes(torch_eff, np.full(4, m), zero, shard, pipelined)
    sharded = FSDP2_SHARD_ADD_BYTES * (m - 1) / m / shard  # every micro-batch but the first adds onto its shard
    unsharded = (FSDP2_UPCAST_BYTES + FSDP2_UNSHARDED_ADD_BYTES * (m - 1)) / m  # upcast once, then add
    assert got == pytest.approx([sharded, sharded, unsharded, unsharded])
    one = grad_accum_bytes(torch_eff, np.ones(4), zero, shard, pipelined)
    assert one == pytest.approx(np.zeros(4))  # one micro-batch: nothing to accumulate


def _count_fsdp2(rank: int, port: int, out: str) -> None:
    """One rank of a 2-rank gloo mesh: the aten ops a tiny Llama's forward + backward issues bare, then wrapped as
    adapt's ``apply_fully_shard`` wraps it (bf16 parameters, fp32 reduction), reducing, and not reducing with the
    parameters kept gathered after backward."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from adapt.runtime.data_parallel import apply_fully_shard
    from parallel_planner.dispatch import _count_ops, _tiny_llama

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    counts = {}
    for zero in (3, 2):
        model, ids = _tiny_llama(torch, "cpu")

        def step():
            model(input_ids=ids, labels=ids).loss.backward()

        bare = _count_ops(torch, step)
        apply_fully_shard(model, model.model.layers, mesh, zero=zero, precision="bf16")
        step()
        groups = len(model.model.layers) + 1
        synced = (_count_ops(torch, step) - bare) / groups
        model.set_requires_gradient_sync(False)  # as adapt's set_micro_batch_sync and pipelining's no-sync do
        model.set_reshard_after_backward(False)
        step()  # the parameters now stay gathered from one micro-batch to the next
        unsynced = (_count_ops(torch, step) - bare) / groups
        counts[str(zero)] = [synced, unsynced]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(counts, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as the ring count does: gloo's threads can abort the interpreter's finalisation (pytorch#190489)


def test_fsdp2_operator_counts_match_a_live_fsdp2_mesh(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = mp.start_processes(_count_fsdp2, args=(port, str(tmp_path / "counts")), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ranks.join(timeout=2):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the 2-rank FSDP2 mesh did not finish in 120 s")
    for r in range(2):
        counts = json.loads((tmp_path / f"counts.{r}").read_text())
        for zero, (synced, unsynced) in counts.items():
            reshard = int(zero) >= 3
            assert synced == pytest.approx(FSDP2_HOST_OPS[reshard, True], abs=0.5)
            assert unsynced == pytest.approx(FSDP2_HOST_OPS[reshard, False], abs=0.5)
