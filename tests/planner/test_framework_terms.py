"""Framework behaviours read off their sources: DeepSpeed's pipeline engine and bf16 optimizer, Megatron-LM 2021's
16-bit gradients, CUDA_LAUNCH_BLOCKING, ALiBi's materialised score bias."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from parallel_planner.cluster import make_cluster
from parallel_planner.comms import Collectives
from parallel_planner.data_parallel_time import _tied_reduction
from parallel_planner.efficiency import Efficiency
from parallel_planner.kernel_rates import SCORE_BIAS_BYTES, score_bias_seconds
from parallel_planner.layout import Candidates, stage_layout
from parallel_planner.profile import profile_model
from parallel_planner.published import PublishedRun, load_published_runs, run_spec
from parallel_planner.runtimes import (
    AUTOGRAD16_ACCUM_BYTES,
    DEEPSPEED_PIPE,
    DS_BF16_ACCUM_BYTES,
    MAIN_GRAD_ACCUM_BYTES,
    RUNTIMES,
    grad_accum_bytes,
)
from parallel_planner.search import FIELDS, plan_parallel
from parallel_planner.workload import Workload
from tests.planner.specs import decoder_spec

MEGATRON = Efficiency(runtime="megatron", attention="unfused")
DEEPSPEED = dataclasses.replace(MEGATRON, runtime=DEEPSPEED_PIPE)


def random_gpt(seq=2048):
    heads = random.choice((8, 16, 32))
    hidden = heads * 128
    return decoder_spec(
        layers=random.choice((4, 8)), hidden=hidden, ffn=4 * hidden, heads=heads, kv_heads=heads, seq=seq, gated=False
    )


def plan(spec, gpus, eff, batch=32, **knobs):
    fixed = dict(tp=1, pp=1, cp=1, zero=1, recompute="full", split="balanced", grad_overlap=0, tp_overlap=0, sp=0)
    fixed.update(knobs)
    cluster = make_cluster("a100", gpus)
    return plan_parallel(spec, cluster, Workload(2048, batch), fixed=fixed, top_k=1, efficiency=eff).best


def test_deepspeed_sends_activation_then_gradient_and_gathers_three_times():
    spec, tp, mbs = random_gpt(), random.choice((2, 4)), random.choice((1, 2))
    knobs = dict(tp=tp, pp=2, dp=8 // tp, mbs=mbs, vpp=1, schedule="1f1b")
    megatron, deepspeed = (plan(spec, 16, e, **knobs) for e in (MEGATRON, DEEPSPEED))
    comm = Collectives(make_cluster("a100", 16), MEGATRON.link_model())
    boundary = np.array([2.0 * mbs * 2048 * spec.hidden_size])
    stride, one = np.array([8]), np.array([1])
    transfer = comm.send_recv(boundary / tp, np.array([2]), stride)[0]
    meta = comm.send_recv(0 * boundary, np.array([2]), stride)[0]
    gather = comm.all_gather(boundary, np.array([tp]), one)[0]
    # per micro-batch: Megatron one exchange each pass and two gathers; DeepSpeed two transfers of two messages
    # each pass and three gathers
    gap = (
        deepspeed.time_breakdown["exposed_comm_per_microbatch"] - megatron.time_breakdown["exposed_comm_per_microbatch"]
    )
    assert gap == pytest.approx(2 * (transfer + 2 * meta) + gather, rel=1e-6)


def test_bf16_optimizer_casts_and_adds_every_micro_batch_into_fp32():
    spec = random_gpt()
    m = random.choice((2, 4, 8))
    knobs = dict(dp=8, mbs=1, batch=8 * m)
    megatron, deepspeed = (plan(spec, 8, e, **knobs) for e in (MEGATRON, DEEPSPEED))
    profile = profile_model(spec)
    local = sum(b.dense_params * b.count for b in profile.blocks) + profile.embed_params + profile.head_params
    if profile.tied:
        local -= profile.vocab * profile.hidden
    hbm = make_cluster("a100", 8).gpu.hbm_gbps * 1e9 * MEGATRON.memory_bw
    gap = deepspeed.time_breakdown["gpu_per_microbatch"] - megatron.time_breakdown["gpu_per_microbatch"]
    assert gap == pytest.approx((DS_BF16_ACCUM_BYTES - MAIN_GRAD_ACCUM_BYTES) * local / hbm, rel=1e-6)


def test_deepspeed_reduces_after_the_flush_whatever_the_overlap_knob():
    spec = random_gpt()
    knobs = dict(dp=8, mbs=1, batch=32)
    ds = [plan(spec, 8, DEEPSPEED, grad_overlap=o, **knobs).time_breakdown["data_parallel_exposed"] for o in (0, 1)]
    mg = [plan(spec, 8, MEGATRON, grad_overlap=o, **knobs).time_breakdown["data_parallel_exposed"] for o in (0, 1)]
    assert ds[0] == pytest.approx(ds[1], rel=1e-12)
    assert mg[1] < mg[0]


def test_tied_embedding_gradient_is_all_reduced_in_fp32_between_the_end_stages():
    spec = random_gpt()
    profile = profile_model(spec)
    assert profile.tied
    pp, tp, dp = random.choice((2, 4)), random.choice((1, 2, 4)), 8  # the end stages sit on different nodes
    layout = stage_layout(profile, pp, 1, "balanced")
    row = dict(tp=tp, pp=pp, dp=dp, cp=1, ep=1, zero=1, recompute=0, mbs=1, vpp=1, schedule=0, split=0, offload=0)
    row.update(replicate=1, sp=0, tp_overlap=0, grad_overlap=0, ep_overlap=0)
    c = Candidates.from_rows([tuple(row[f] for f in FIELDS)])
    comm = Collectives(make_cluster("a100", pp * tp * dp), MEGATRON.link_model())
    seconds = _tied_reduction(profile, layout, c, comm)[0]
    expected = comm.time(
        "all_reduce", np.array([4.0 * profile.vocab * profile.hidden / tp]), np.array([2]), np.array([64])
    )
    assert seconds[0] == seconds[-1] == pytest.approx(expected[0], rel=1e-9)
    assert not seconds[1:-1].any()


def test_launch_blocking_pays_host_and_gpu_in_series():
    spec = random_gpt()
    blocking = dataclasses.replace(MEGATRON, launch_blocking=True)
    knobs = dict(dp=8, mbs=1, batch=8 * random.choice((1, 2, 4)))
    fast, slow = (plan(spec, 8, e, **knobs) for e in (MEGATRON, blocking))
    t = slow.time_breakdown
    assert t["pipeline"] == pytest.approx((knobs["batch"] // 8) * (t["gpu_per_microbatch"] + t["host_per_microbatch"]))
    assert fast.time_breakdown["pipeline"] < t["pipeline"]


def test_a_pipelined_torch_run_hides_its_host_behind_the_gpu():
    """torch.distributed.pipelining waits on its P2P with ``Work.wait()``, which makes the compute stream wait, not
    the host: each micro-batch costs its stage the slower of host and GPU, never their sum."""
    spec = random_gpt()
    torch_run = Efficiency(runtime="torch", attention="flash2", fused_kernels=random.choice((True, False)))
    micro = random.choice((2, 4, 8))
    t = plan(spec, 8, torch_run, pp=2, dp=4, mbs=1, vpp=1, schedule="1f1b", batch=4 * micro).time_breakdown
    steady = micro * max(t["gpu_per_microbatch"], t["host_per_microbatch"])
    assert t["pipeline"] - t["bubble"] == pytest.approx(steady, rel=1e-9)
    assert steady < micro * (t["gpu_per_microbatch"] + t["host_per_microbatch"])


def test_alibi_bias_costs_a_write_and_a_read_per_score_in_unfused_forward_passes():
    heads = random.choice((8, 16))
    bloom = next(r for r in load_published_runs() if r.source == "bloom")
    run = dataclasses.replace(bloom, layers=2, hidden=heads * 128, ffn=heads * 512, heads=heads)
    run = dataclasses.replace(run, kv_heads=heads, vocab=1024)
    assert run.source == "bloom"
    block = profile_model(run_spec(run)).blocks[0]
    assert block.score_bias
    cluster, tokens, tp = make_cluster("a100", 8), random.choice((2048, 4096)), random.choice((1, 2))
    scores = tokens * 2048 * heads / tp
    hbm = cluster.gpu.hbm_gbps * 1e9 * MEGATRON.memory_bw
    assert score_bias_seconds(block, tokens, tp, 2048, cluster, MEGATRON) == pytest.approx(
        SCORE_BIAS_BYTES * scores / hbm
    )
    flash = dataclasses.replace(MEGATRON, attention="flash2")
    assert score_bias_seconds(block, tokens, tp, 2048, cluster, flash) == 0.0
    assert not profile_model(random_gpt()).blocks[0].score_bias


def test_sixteen_bit_gradients_accumulate_in_place_and_reduce_half_the_bytes():
    m = np.array([1.0, random.choice((2.0, 4.0, 8.0))])
    sixteen = dataclasses.replace(MEGATRON, grads16=True)
    assert grad_accum_bytes(sixteen, m) == pytest.approx(AUTOGRAD16_ACCUM_BYTES * (m - 1) / m)
    spec = random_gpt()
    knobs = dict(dp=8, mbs=1, batch=16, zero=0)
    fp32, fp16 = (plan(spec, 8, e, **knobs).time_breakdown["data_parallel_exposed"] for e in (MEGATRON, sixteen))
    assert fp16 < 0.6 * fp32


def test_runtimes_and_published_software():
    with pytest.raises(ValueError):
        Efficiency(runtime="colossal")
    runs = load_published_runs()
    assert {r.framework for r in runs} <= set(RUNTIMES)
    bloom = next(r for r in runs if r.source == "bloom")
    assert bloom.framework == DEEPSPEED_PIPE and bloom.launch_blocking and bloom.dropout
    for run in (r for r in runs if r.source == "megatron2021"):  # the authors' Table 1 scripts state these
        assert run.mbs and run.grad_bits == 16 and (run.vpp or run.pp == 1)
        assert run.grad_overlap == (run.pp == 1)  # torch DDP overlaps; Megatron's local DDP reduces after the flush
    assert isinstance(bloom, PublishedRun)
