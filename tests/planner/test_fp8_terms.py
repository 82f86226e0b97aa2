"""An fp8 recipe's two costs: its GEMMs at the scaling recipe's measured rate, and the casts around each GEMM."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from adapt.app.cli import main
from adapt.core.errors import BadInput
from parallel_planner.cluster import make_cluster
from parallel_planner.efficiency import Efficiency
from parallel_planner.kernel_rates import (
    FP8_CAST_BYTES,
    FP8_SCALING_RATE,
    FP8_TRANSPOSED_CAST_RATE,
    fp8_cast_seconds,
    gemm_peak,
)
from parallel_planner.profile import profile_model
from parallel_planner.published import PublishedRun, load_published_runs
from parallel_planner.workload import Workload
from tests.planner.specs import decoder_spec

MEGATRON = Efficiency(runtime="megatron", attention="flash3")


def test_fp8_gemms_run_at_their_scaling_recipes_measured_share_of_the_fp8_peak():
    cluster = make_cluster(random.choice(("h100", "h800", "h200")), 8)
    assert gemm_peak(cluster, "bf16", MEGATRON) == cluster.gpu.peak_flops("bf16")
    for recipe, rate in FP8_SCALING_RATE.items():
        eff = dataclasses.replace(MEGATRON, fp8_scaling=recipe)
        assert gemm_peak(cluster, "fp8", eff) == pytest.approx(cluster.gpu.peak_flops("fp8") * rate)
        assert gemm_peak(cluster, "bf16", eff) == cluster.gpu.peak_flops("bf16")
    # finer scales cost more: one scale per tensor, per row, per block
    assert FP8_SCALING_RATE["tensorwise"] > FP8_SCALING_RATE["rowwise"] > FP8_SCALING_RATE["blockwise"] > 0.5
    with pytest.raises(ValueError, match="fp8 scaling"):
        Efficiency(fp8_scaling="per_channel")


def test_casts_read_and_write_each_gemm_operand_and_transpose_for_the_weight_gradient():
    heads = random.choice((8, 16))
    block = profile_model(decoder_spec(hidden=heads * 128, ffn=heads * 512, heads=heads, kv_heads=heads // 2)).blocks[0]
    cluster, tokens, one = make_cluster("h100", 8), np.array([float(random.choice((2048, 8192)))]), np.array([1])
    hbm = cluster.gpu.hbm_gbps * 1e9 * MEGATRON.memory_bw
    k = sum(g.in_features for g in block.gemms)
    n = sum(g.out_features for g in block.gemms)
    for cache_bits, cached in ((16, 2), (8, 1)):
        workload = Workload(4096, 64, precision="fp8", act_cache_bits=cache_bits)
        forward, backward = fp8_cast_seconds(block, tokens, one, one, cluster, workload, MEGATRON)
        assert forward == pytest.approx(FP8_CAST_BYTES * tokens * k / hbm)
        column_wise = tokens * (FP8_CAST_BYTES * n + (cached + 1) * k) / (hbm * FP8_TRANSPOSED_CAST_RATE)
        assert backward == pytest.approx(FP8_CAST_BYTES * tokens * n / hbm + column_wise)
    assert fp8_cast_seconds(block, tokens, one, one, cluster, Workload(4096, 64), MEGATRON) == (0.0, 0.0)


def test_fp8_dispatch_casts_the_experts_first_input_once_per_token(deepseek_v3_spec):
    block = next(b for b in profile_model(deepseek_v3_spec).blocks if b.is_moe)
    cluster, tokens, tp, ep = make_cluster("h800", 64), np.array([4096.0]), np.array([1]), np.array([8])
    workload = Workload(4096, 64, precision="fp8", moe_imbalance=random.uniform(1.0, 1.5))
    flat, _ = fp8_cast_seconds(block, tokens, tp, ep, cluster, workload, MEGATRON)
    dispatched, _ = fp8_cast_seconds(
        block, tokens, tp, ep, cluster, workload, dataclasses.replace(MEGATRON, ep_fp8_dispatch=True)
    )
    first = [g for g in block.gemms if g.routed and g.in_features == block.hidden]
    assert first
    copies = block.top_k * workload.moe_imbalance
    hbm = cluster.gpu.hbm_gbps * 1e9 * MEGATRON.memory_bw
    saved = sum(FP8_CAST_BYTES * tokens * (copies - 1) * g.in_features for g in first) / hbm
    assert flat - dispatched == pytest.approx(saved)


def test_deepseek_states_its_block_scales_and_an_unknown_recipe_is_refused(spec_json, capsys):
    (row,) = [r for r in load_published_runs() if r.precision == "fp8"]
    assert row.fp8_scaling == "blockwise" and row.efficiency().fp8_scaling == "blockwise"
    fields = {f.name: getattr(row, f.name) for f in dataclasses.fields(PublishedRun)}
    with pytest.raises(BadInput, match="fp8_scaling"):
        PublishedRun(**dict(fields, fp8_scaling="per_channel"))
    base = ["plan", str(spec_json), "--gpus", "8", "--gpu", "h100", "--seq", "2048", "--global-batch", "64"]
    assert main([*base, "--precision", "fp8", "--fp8-scaling", "blockwise", "--json"]) == 0
    blockwise = capsys.readouterr().out
    assert main([*base, "--precision", "fp8", "--json"]) == 0
    assert blockwise != capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main([*base, "--fp8-scaling", "per_channel"])
    assert refused.value.code == 2
    assert "--fp8-scaling" in capsys.readouterr().err
