"""How the torch runtime's own work enters the time model: ring attention, FSDP2's copies and exposed edges."""

from __future__ import annotations

import dataclasses
import random

import pytest

from parallel_planner.cluster import make_cluster
from parallel_planner.dispatch import DispatchCosts
from parallel_planner.search import plan_parallel
from parallel_planner.timing import CP_DTENSOR_OPS, CP_RING_OPS_PER_STEP, Efficiency
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
        added = spec.num_layers * (CP_RING_OPS_PER_STEP * cp * host.eager_s + CP_DTENSOR_OPS * host.dtensor_s)
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


def test_fsdp2_exposes_the_root_group_so_a_larger_vocabulary_exposes_more():
    small = decoder_spec(layers=8, vocab=8000)
    large = decoder_spec(layers=8, vocab=256000)

    def exposed_comm(spec, gpus):
        return run(spec, gpus, dp=gpus, cp=1, mbs=1, batch=gpus).time_breakdown["data_parallel_exposed"]

    # the copies are the same on both meshes per parameter shard; what grows with the root is communication
    small_comm = exposed_comm(small, 2) - exposed_comm(small, 1) / 2
    large_comm = exposed_comm(large, 2) - exposed_comm(large, 1) / 2
    root_share = lambda s: s.vocab_size * s.hidden_size / s.params.total  # noqa: E731
    assert large_comm / small_comm > root_share(large) / root_share(small) / 4 > 1
