"""Terms the Megatron-Core rows brought in: Megatron's fp32 cross-entropy, its even pipeline chunks, its MFU count,
and the planner's choice of knobs a source leaves unstated."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from parallel_planner.cluster import make_cluster
from parallel_planner.efficiency import Efficiency
from parallel_planner.kernel_rates import loss_seconds
from parallel_planner.profile import profile_model
from parallel_planner.published import PublishedRun, load_published_runs, run_spec
from parallel_planner.published_eval import evaluate, knob_range


def gpt_run(**over) -> PublishedRun:
    """A random Megatron-Core GPT row (GeLU, ffn 4h, untied), small enough to plan in milliseconds."""
    heads = random.choice((8, 16))
    hidden = heads * 128
    fields = dict(
        source="mcore2024",
        model="gpt-test",
        params_b=1.0,
        layers=random.choice((12, 16, 24)),
        hidden=hidden,
        ffn=4 * hidden,
        heads=heads,
        kv_heads=heads,
        vocab=random.choice((32768, 65536, 131072)),
        seq=random.choice((2048, 4096)),
        gpu="h100",
        gpus=16,
        tp=2,
        pp=2,
        dp=4,
        cp=1,
        ep=1,
        zero=1,
        global_batch_seqs=64,
        recompute="",
        reported_tflops_per_gpu=400.0,
        reported_pct_peak=40.0,
        attention="flash3",
        flop_convention="megatron_mfu",
        sp=1,
        grad_accum_fused=1,
        split="balanced",
        citation="test",
    )
    return PublishedRun(**{**fields, **over})


def test_megatron_loss_costs_more_than_torch_and_scales_with_local_logits():
    cluster = make_cluster("h100", 8)
    tokens = np.array([float(random.randint(1, 8) * 4096)])
    vocab, tp = random.choice((50304, 128256, 131072)), np.array([random.choice((1, 2, 4, 8))])
    megatron = loss_seconds(tokens, vocab, tp, cluster, Efficiency(runtime="megatron"))
    torch = loss_seconds(tokens, vocab, tp, cluster, Efficiency(runtime="torch"))
    assert sum(megatron) > sum(torch) > 0  # the fp32 upcast and in-place passes Megatron's loss makes
    doubled = loss_seconds(2 * tokens, vocab, 2 * tp, cluster, Efficiency(runtime="megatron"))
    np.testing.assert_allclose(sum(doubled), sum(megatron))  # bytes follow the logits each rank holds
    assert sum(loss_seconds(tokens, 2 * vocab, tp, cluster, Efficiency(runtime="megatron"))) > sum(megatron)


def test_unstated_vpp_is_chosen_among_the_even_chunks_megatron_builds():
    run = gpt_run()
    per_stage = run.layers // run.pp
    assert 1 in run.vpp_choices and all(per_stage % v == 0 for v in run.vpp_choices)
    assert not dataclasses.replace(run, vpp=2).vpp_choices  # stated: planned as given
    assert not dataclasses.replace(run, framework="torch").vpp_choices  # torch splits freely
    assert not dataclasses.replace(run, pp=1, dp=8).vpp_choices
    (row,) = evaluate([run], search=False)
    assert row["chosen"]["vpp"] in run.vpp_choices
    assert row["chosen"]["recompute"] in ("none", "selective", "full")  # unstated: the planner's choice


def test_megatron_mfu_count_is_full_attention_without_recompute():
    run = gpt_run()
    spec = run_spec(run)
    mfu = run.published_tokens_per_s_per_gpu(spec)
    recompute = dataclasses.replace(run, flop_convention="megatron_recompute").published_tokens_per_s_per_gpu(spec)
    causal = dataclasses.replace(run, flop_convention="adapt").published_tokens_per_s_per_gpu(spec)
    # the 2021 count adds the blocks' recomputed forward (full square), one third of their 3x: not the head
    per_token = run.reported_tflops_per_gpu * 1e12 * (1 / recompute - 1 / mfu)
    l, h, s = run.layers, run.hidden, run.seq
    np.testing.assert_allclose(per_token, 24 * l * h * h * (1 + s / (6 * h)))
    assert mfu < causal  # the full attention square counts more FLOPs than the causal half
    flops = profile_model(spec).model_flops_per_token(run.seq)
    np.testing.assert_allclose(run.reported_tflops_per_gpu * 1e12 / causal, flops)


def test_knob_range_spans_unstated_micro_batch_without_pipelining():
    run = gpt_run(pp=1, dp=8)
    low, high = knob_range(run)
    assert 0 < low <= high


def test_megatron_core_rows_leave_unstated_knobs_to_the_planner():
    rows = [r for r in load_published_runs() if r.source == "mcore2024"]
    assert rows and all(r.flop_convention == "megatron_mfu" and r.grad_accum_fused for r in rows)
    assert all(not r.recompute and not r.mbs and (r.pp == 1 or r.vpp_choices) for r in rows)
    assert all(r.sp and r.tp_overlap for r in rows if r.tp > 1)  # --tp-comm-overlap needs sequence parallel
