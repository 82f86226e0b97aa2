"""torchtitan's op-level selective recompute: every compute op's output is kept except every second matmul of a
block, which the backward runs again (its checkpoint policy recomputes an ``aten.mm`` whose count is even)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from adapt.core.errors import BadInput
from parallel_planner.cluster import make_cluster
from parallel_planner.efficiency import Efficiency
from parallel_planner.kernel_rates import gemm_seconds
from parallel_planner.profile import profile_model
from parallel_planner.published import PublishedRun, load_published_runs
from parallel_planner.search import plan_parallel
from parallel_planner.timing import alternate_matmul_seconds
from parallel_planner.workload import Workload
from tests.planner.specs import decoder_spec

TORCH = Efficiency(runtime="torch", fused_kernels=False)


def test_the_rerun_matmuls_are_k_o_and_up_of_a_gated_gqa_block():
    heads, kv_heads = random.choice(((32, 8), (16, 4), (8, 8)))
    hidden, ffn = heads * 128, random.choice((2816, 5632, 14336))
    (block,) = profile_model(decoder_spec(layers=2, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv_heads)).blocks[:1]
    cluster, tokens = make_cluster("a100", 8), 8192
    rerun = alternate_matmul_seconds(block, tokens, 1, 1, cluster, "bf16", TORCH, 1.0)
    peak = cluster.gpu.peak_flops("bf16")
    k, o, up = (gemm_seconds(tokens, hidden, n, cluster, peak, TORCH) for n in (kv_heads * 128, hidden, ffn))
    assert rerun == pytest.approx(block.flops_scale * (k + o + up), rel=1e-9)


def _fixed_step(eff: Efficiency) -> float:
    spec = decoder_spec(layers=4, hidden=2048, ffn=5632, heads=16, kv_heads=4, seq=4096)
    fixed = {"tp": 1, "pp": 1, "dp": 8, "zero": 3, "recompute": "selective", "mbs": 1}
    plan = plan_parallel(spec, make_cluster("a100", 8), Workload(4096, 8), fixed=fixed, top_k=1, efficiency=eff).best
    return plan.step_time_s


def test_the_policy_makes_a_selective_step_slower_by_the_rerun_matmuls_only():
    plain = _fixed_step(TORCH)
    op_level = _fixed_step(dataclasses.replace(TORCH, selective_alternate_matmuls=True))
    assert plain < op_level < 1.2 * plain


def test_torchtitans_selective_row_states_the_policy_and_an_unknown_policy_is_refused():
    (row,) = [r for r in load_published_runs() if r.source == "torchtitan2024" and r.recompute == "selective"]
    assert row.recompute_policy == "alternate_mm" and row.efficiency().selective_alternate_matmuls
    fields = {f.name: getattr(row, f.name) for f in dataclasses.fields(PublishedRun)}
    with pytest.raises(BadInput, match="recompute_policy"):
        PublishedRun(**dict(fields, recompute_policy="every_mm"))
