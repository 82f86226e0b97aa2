"""How the torch runtime's own work enters the time model: ring attention, FSDP2's copies and exposed edges."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import pytest

from parallel_planner.cluster import make_cluster
from parallel_planner.dispatch import DispatchCosts
from parallel_planner.efficiency import Efficiency
from parallel_planner.search import plan_parallel
from parallel_planner.timing import CP_DTENSOR_OPS, CP_RING_KERNELS, CP_RING_OPS, ring_count
from parallel_planner.workload import Workload
from tests.planner.specs import decoder_spec

EAGER = Efficiency(fused_kernels=False)


def run(spec, gpus, eff=EAGER, seq=2048, batch=8, link_gbps=None, **knobs):
    defaults = dict(tp=1, pp=1, zero=3, recompute="none", split="balanced", grad_overlap=1, tp_overlap=0)
    fixed = {**defaults, **knobs}
    cluster = make_cluster("h200", gpus)
    if link_gbps:
        cluster = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, intra_node_gbps=link_gbps))
    return plan_parallel(spec, cluster, Workload(seq, batch), fixed=fixed, top_k=1, efficiency=eff).best


def random_spec():
    heads = random.choice((8, 16, 32))
    return decoder_spec(
        layers=random.choice((4, 8, 12)),
        hidden=heads * 64,
        ffn=heads * 64 * random.choice((3, 4)),
        heads=heads,
        kv_heads=heads // random.choice((1, 2, 4)),
        vocab=random.choice((8000, 32000, 128000)),
    )


def test_torch_ring_attention_issues_its_own_operators_per_ring_step():
    spec = random_spec()
    host = DispatchCosts(eager_s=random.uniform(5e-6, 3e-5), dtensor_s=random.uniform(5e-5, 2e-4))
    eff = Efficiency(fused_kernels=False, host=host)
    plain = run(spec, 2, eff, dp=2, cp=1, mbs=2).time_breakdown["host_per_microbatch"]
    for cp in (2, 4):
        ring = run(spec, cp, eff, dp=1, cp=cp, mbs=cp).time_breakdown["host_per_microbatch"]
        ring_ops = ring_count(CP_RING_OPS["forward"], cp) + ring_count(CP_RING_OPS["backward"], cp)
        added = spec.num_layers * (ring_ops * host.eager_s + CP_DTENSOR_OPS * host.dtensor_s)
        assert ring - plain == pytest.approx(added, rel=1e-9)
    # Megatron's context parallelism (Transformer Engine) is one fused attention call: nothing added.
    megatron = Efficiency(fused_kernels=False, host=host, runtime="megatron")
    same = run(spec, 2, megatron, dp=1, cp=2, mbs=2).time_breakdown["host_per_microbatch"]
    assert same == pytest.approx(run(spec, 2, megatron, dp=2, cp=1, mbs=2).time_breakdown["host_per_microbatch"])


def test_ring_gpu_work_grows_with_the_ring_and_its_last_gradient_exchange_is_exposed():
    spec = random_spec()
    # cp ranks each hold seq/cp tokens of one sequence: the same per-rank tokens at twice the ring length
    two = run(spec, 2, dp=1, cp=2, mbs=1, seq=4096, batch=1).time_breakdown
    four = run(spec, 4, dp=1, cp=4, mbs=1, seq=8192, batch=1).time_breakdown
    assert four["compute_per_microbatch"] > two["compute_per_microbatch"]
    # however long the attention, each block's last K/V-gradient exchange waits on the link: a slower link
    # lengthens the backward, and torch's fp32 gradients (twice the bytes) more than Megatron's bf16
    slowdown = {}
    for runtime in ("torch", "megatron"):
        eff = Efficiency(fused_kernels=False, runtime=runtime)
        passes = [
            run(spec, 8, eff, link_gbps=link, dp=1, cp=8, mbs=1, seq=16384, batch=1).time_breakdown
            for link in (450, 45)
        ]
        slowdown[runtime] = passes[1]["compute_per_microbatch"] - passes[0]["compute_per_microbatch"]
    assert slowdown["torch"] > slowdown["megatron"] > 0


def test_fsdp2_copies_are_paid_on_a_one_wide_mesh_and_pipelining_gathers_less():
    spec = random_spec()
    one = run(spec, 1, dp=1, cp=1, mbs=1, batch=4).time_breakdown["data_parallel_exposed"]
    assert one > 0  # no communication at all: FSDP2's casts and copies
    megatron = run(spec, 1, Efficiency(fused_kernels=False, runtime="megatron"), dp=1, cp=1, mbs=1, batch=4)
    assert megatron.time_breakdown["data_parallel_exposed"] == 0
    # 1F1B through torch.distributed.pipelining: no reshard after backward but the last, so m + 1 gathers and
    # one reduction per step on each stage instead of 2m gathers and m reductions.
    stages = run(spec, 2, dp=1, cp=1, pp=2, mbs=1, batch=8, schedule="1f1b", vpp=1)
    per_stage = spec.params.total / 2
    hbm = make_cluster("h200", 2).gpu.hbm_gbps * 1e9 * EAGER.memory_bw
    naive = (16 * 10 + 8 * 14) * per_stage / hbm
    assert stages.time_breakdown["data_parallel_exposed"] < 0.8 * naive


def test_data_parallel_communication_hides_behind_compute_when_it_may_overlap():
    spec = random_spec()
    eff = Efficiency(fused_kernels=False, runtime="megatron")
    hidden = run(spec, 8, eff, dp=8, cp=1, mbs=1, zero=1, grad_overlap=1, batch=32).time_breakdown
    after = run(spec, 8, eff, dp=8, cp=1, mbs=1, zero=1, grad_overlap=0, batch=32).time_breakdown
    assert 0 < hidden["data_parallel_exposed"] < after["data_parallel_exposed"]


def test_fsdp2_ends_of_a_pass_carry_the_root_group_and_a_block():
    from parallel_planner.data_parallel_time import _fsdp2_edge
    from parallel_planner.layout import stage_layout
    from parallel_planner.memory import stage_params
    from parallel_planner.profile import profile_model

    def edge(spec):
        profile = profile_model(spec)
        layout = stage_layout(profile, 1, 1, "balanced")
        dense, experts = stage_params(profile, layout)
        block = profile.blocks[0].dense_params
        root = dense[0] - spec.num_layers * block
        share = _fsdp2_edge(profile, layout, dense, experts)[0]
        assert share == pytest.approx((root + block) / dense[0])
        return share

    layers, hidden = random.choice((8, 16)), random.choice((512, 1024))
    small = edge(decoder_spec(layers=layers, hidden=hidden, heads=hidden // 64, vocab=8000))
    large = edge(decoder_spec(layers=layers, hidden=hidden, heads=hidden // 64, vocab=128000))
    assert 1 / (layers + 1) < small < large  # a Megatron bucket's share is one block's


VIEWS = {"view", "slice", "split", "squeeze", "unsqueeze", "_wrap_tensor_autograd", "wait_tensor"}


def _count_ring(rank: int, port: int, out: str) -> None:
    """One rank of a live 2-rank load-balanced ring (gloo, CPU flash kernels): its ops forward and backward."""
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def forward(q, k, v, is_causal=False, **_):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)

    def backward(query, key, value, out, logsumexp, is_causal=False, grad_out=None, **_):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, 0.0, is_causal
        )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ring._cp_options.enable_load_balance = True
    q, k, v = (torch.randn(1, 4, 16, 8, dtype=torch.bfloat16) for _ in range(3))
    fwd, bwd = Count(), Count()
    with fwd:
        o, lse = ring._templated_ring_attention(dist.group.WORLD, 2, forward, q, k, v, is_causal=True)
    grad = torch.randn_like(o)
    with bwd:
        ring._templated_ring_attention_backward(dist.group.WORLD, 2, backward, grad, "grad_out", q, k, v, o, lse, True)
    counts = [len(fwd.ops), len(bwd.ops), sum(o not in VIEWS for o in fwd.ops), sum(o not in VIEWS for o in bwd.ops)]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(counts, f)
    # both ranks must be past their last send before either tears gloo down: one rank destroying its
    # group while the other's transfer is still in flight aborts the process
    dist.barrier()
    dist.destroy_process_group()
    # gloo's worker threads can still hold finished work whose tensors point into Python; the
    # interpreter's finalisation then aborts the rank now and again (pytorch/pytorch#190489), after
    # its counts are on disk. Leave without finalising: there is nothing left to flush.
    os._exit(0)


def test_ring_operator_counts_match_a_live_torch_ring(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawned, not forked: a fork of a process that already runs torch's threads can hang in gloo
    ring = mp.start_processes(_count_ring, args=(port, str(tmp_path / "counts")), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ring.join(timeout=2):
        if time.monotonic() > deadline:
            for process in ring.processes:
                process.kill()
            pytest.fail("the 2-rank ring did not finish in 120 s")
    ranks = [json.loads((tmp_path / f"counts.{r}").read_text()) for r in range(2)]
    mean = [sum(r[i] for r in ranks) / 2 for i in range(4)]
    assert mean == [
        CP_RING_OPS["forward"][0],
        CP_RING_OPS["backward"][0],
        CP_RING_KERNELS["forward"][0],
        CP_RING_KERNELS["backward"][0],
    ]
