"""MoE and fp8 terms a DeepSeek-V3-class run states: the all-to-all per target node under group-limited routing,
fp8 dispatch, EP overlap, DualPipe, bf16 moments, fp8-cached activations, the weighted activation, MLA recompute."""

from __future__ import annotations

import dataclasses
import json
import random
from itertools import combinations

import numpy as np
import pytest

from adapt.app.cli import main
from adapt.core.errors import BadInput
from parallel_planner.cluster import make_cluster
from parallel_planner.comms import Collectives
from parallel_planner.efficiency import Efficiency
from parallel_planner.expert_comm import expert_all_to_all_seconds, exposed_all_to_all, nodes_reached
from parallel_planner.kernel_rates import FP8_SCALING_RATE, gemm_seconds
from parallel_planner.knobs import parse_fixed
from parallel_planner.layout import FIELDS, SCHEDULES, Candidates, stage_layout
from parallel_planner.memory import ACT_BYTES, FP8_BYTES, MemoryModel, activation_bytes_per_block, memory_breakdown
from parallel_planner.profile import profile_model, with_prediction_modules
from parallel_planner.published import load_published_runs
from parallel_planner.search import plan_parallel
from parallel_planner.timing import recomputed_gemm_seconds, step_time
from parallel_planner.workload import Workload
from tests.planner.specs import decoder_spec

MEGATRON = Efficiency(runtime="megatron", attention="flash3")
ROW = dict(tp=1, pp=1, dp=8, cp=1, ep=1, zero=1, recompute=0, mbs=1, vpp=1, schedule=0, offload=0, split=0)
ROW.update(replicate=1, sp=0, tp_overlap=0, grad_overlap=1, ep_overlap=0)


def candidates(**knobs) -> Candidates:
    row = {**ROW, **knobs}
    return Candidates.from_rows([tuple(row[f] for f in FIELDS)])


@pytest.fixture(scope="module")
def moe_block(deepseek_v3_spec):
    return next(b for b in profile_model(deepseek_v3_spec).blocks if b.is_moe)


def _reach_by_enumeration(experts: int, groups: int, picked: int, top_k: int, nodes: int) -> int:
    """Most nodes a token's top-k experts can span when they come from ``picked`` of ``groups`` contiguous groups
    and the experts lie contiguously over ``nodes`` nodes: every choice of groups enumerated."""
    node_of = [e * nodes // experts for e in range(experts)]
    group_of = [e * groups // experts for e in range(experts)]
    return max(
        min(top_k, len({node_of[e] for e in range(experts) if group_of[e] in chosen}))
        for chosen in combinations(range(groups), picked)
    )


def test_nodes_reached_bounds_every_routing_choice(moe_block):
    for _ in range(20):
        nodes, groups = random.choice((2, 4, 8)), random.choice((1, 2, 4, 8, 16))
        picked = random.randint(1, groups) if groups > 1 else 1
        top_k = random.choice((2, 4, 6, 8))
        experts = 16 * max(nodes, groups)
        block = dataclasses.replace(
            moe_block, num_experts=experts, top_k=top_k, expert_groups=groups, groups_per_token=picked
        )
        reach = float(nodes_reached(block, np.array([8 * nodes]), np.array([1]), 8)[0])
        exact = _reach_by_enumeration(experts, groups, picked, top_k, nodes)
        assert reach >= exact, (nodes, groups, picked, top_k)
        if groups % nodes == 0 or nodes % groups == 0:  # groups line up with nodes: the bound is reached
            assert reach == exact, (nodes, groups, picked, top_k)


def test_forwarded_all_to_all_crosses_the_network_once_per_remote_node():
    cluster = make_cluster("h800", 256)
    eff = Efficiency()
    comm = Collectives(cluster, eff.link_model())
    nodes, copies = random.choice((2, 4, 8, 16)), random.choice((4, 8))
    reach = random.uniform(1, min(copies, nodes))
    nbytes = random.uniform(1e6, 1e9)
    inter = cluster.gpu.inter_node_gbps * 1e9 * eff.network
    intra = cluster.gpu.intra_node_gbps * 1e9 * eff.network
    expected = (
        eff.alpha_inter_s
        + eff.alpha_intra_s
        + nbytes * max(reach * (nodes - 1) / nodes / inter, copies * 7 / 8 / intra)
    )
    got = comm.forwarded_all_to_all(np.array([nbytes]), copies, np.array([reach]), np.array([8 * nodes]), np.ones(1))
    assert got[0] == pytest.approx(expected, rel=1e-12)
    inside = comm.forwarded_all_to_all(np.array([nbytes]), copies, np.array([1.0]), np.array([8]), np.ones(1))
    assert inside[0] == pytest.approx(comm.all_to_all(np.array([copies * nbytes]), np.array([8]), np.ones(1))[0])


def test_fp8_dispatch_sends_its_bytes_and_a_scale_per_128_elements(moe_block):
    cluster = make_cluster("h800", 512)
    comm = Collectives(cluster, MEGATRON.link_model())
    tokens, ep, one = np.array([float(random.choice((2048, 4096, 8192)))]), np.array([64]), np.array([1])
    imbalance = random.uniform(1.0, 1.3)
    bf16 = expert_all_to_all_seconds(moe_block, tokens, one, ep, comm, 8, imbalance, MEGATRON)
    fp8 = dataclasses.replace(MEGATRON, ep_fp8_dispatch=True)
    quantised = expert_all_to_all_seconds(moe_block, tokens, one, ep, comm, 8, imbalance, fp8)
    _, per_byte = comm.affine("all_to_all", ep, one)
    saved = (ACT_BYTES - FP8_BYTES) * tokens * moe_block.hidden * imbalance * moe_block.top_k * per_byte
    assert bf16[0] - quantised[0] == pytest.approx(saved[0], rel=1e-9)
    assert FP8_BYTES == 1 + 4 / 128


def test_ep_overlap_hides_the_all_to_all_behind_the_other_micro_batch():
    one_pass, work = np.random.uniform(0, 0.05, 64), np.random.uniform(0, 0.05, 64)
    full = np.random.rand(64) < 0.5
    overlap = random.uniform(0.5, 0.95)
    got = exposed_all_to_all(one_pass, work, full, np.ones(64), overlap)
    total = (2 + full) * one_pass
    reference = (np.maximum(0, total - overlap * work) + (1 - overlap) * np.minimum(total, work)) / (2 + full)
    np.testing.assert_allclose(got, reference, rtol=1e-12)
    assert (got <= one_pass + 1e-15).all()  # never more exposed than alone: the open search keeps it on
    np.testing.assert_array_equal(exposed_all_to_all(one_pass, work, full, np.zeros(64), overlap), one_pass)


def test_ep_overlap_is_a_fixed_knob_and_needs_a_second_micro_batch(deepseek_v3_spec):
    assert parse_fixed("overlap_moe_expert_parallel_comm=true") == {"ep_overlap": 1}
    cluster, eff = make_cluster("h800", 512), dataclasses.replace(MEGATRON, ep_forwarded=True)
    layout = dict(tp=1, pp=1, dp=512, cp=1, ep=64, zero=1, recompute="selective", mbs=1)
    times = {}
    for batch in (512, 512 * random.choice((2, 4))):
        for overlap in (0, 1):
            best = plan_parallel(
                deepseek_v3_spec, cluster, Workload(4096, batch), fixed={**layout, "ep_overlap": overlap},
                top_k=1, efficiency=eff,
            ).best  # fmt: skip
            times[batch, overlap] = best.time_breakdown["exposed_comm_per_microbatch"]
    (single, more) = sorted({b for b, _ in times})
    assert times[single, 1] == times[single, 0]  # one micro-batch: nothing to run beside
    assert times[more, 1] < times[more, 0]


def test_bf16_moments_halve_optimizer_states_and_fp8_needs_fp8_precision():
    spec = decoder_spec()
    fixed = dict(tp=1, pp=1, dp=8, cp=1, zero=1, recompute="none", mbs=1)
    states = [
        plan_parallel(
            spec, make_cluster("h100", 8), Workload(2048, 64, moment_bits=bits), fixed=fixed, top_k=1
        ).best.memory_breakdown["optimizer_states"]
        for bits in (32, 16)
    ]
    assert states[1] == pytest.approx(states[0] / 2, rel=1e-12)
    with pytest.raises(BadInput):
        Workload(2048, 64, act_cache_bits=8)


def test_fp8_cache_and_weighted_activation_drop_exactly_their_bytes(deepseek_v3_spec):
    profile = profile_model(deepseek_v3_spec)
    j = next(i for i, b in enumerate(profile.blocks) if b.is_moe)
    b = profile.blocks[j]
    imbalance = random.uniform(1.0, 1.5)
    c = candidates(ep=8, mbs=random.choice((1, 2)))
    tokens = float(c.mbs[0] * 4096)
    base, cached = (Workload(4096, 64, precision="fp8", moe_imbalance=imbalance, act_cache_bits=n) for n in (16, 8))
    plain = activation_bytes_per_block(profile, base, c)[0, j]
    fp8 = activation_bytes_per_block(profile, cached, c)[0, j]
    weighted = activation_bytes_per_block(profile, base, c, weighted=True)[0, j]
    per_token = b.cacheable_width + imbalance * b.top_k * b.routed_cacheable_width
    assert plain - fp8 == pytest.approx((ACT_BYTES - FP8_BYTES) * tokens * per_token, rel=1e-9)
    assert plain - weighted == pytest.approx(ACT_BYTES * tokens * imbalance * b.top_k * b.hidden, rel=1e-9)


def test_selective_recompute_reruns_mla_up_projections(deepseek_v3_spec):
    cfg = deepseek_v3_spec.blocks[-1].attention
    profile = profile_model(deepseek_v3_spec)
    cluster = make_cluster("h800", 8)
    for block in profile.blocks:
        again = [g for g in block.gemms if g.recomputed]
        assert {(g.in_features, g.out_features) for g in again} == {
            (cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
            (cfg.q_lora_rank, cfg.num_heads * cfg.head_dim),
        }
        tokens = np.array([float(random.choice((1024, 4096)))])
        fp8_peak = 1979e12 * FP8_SCALING_RATE[MEGATRON.fp8_scaling]  # the recipe's measured share of the fp8 peak
        expected = sum(gemm_seconds(tokens, g.in_features, g.out_features, cluster, fp8_peak, MEGATRON) for g in again)
        got = recomputed_gemm_seconds(block, tokens, np.ones(1), np.ones(1), cluster, "fp8", MEGATRON, 1.0)
        assert got[0] == pytest.approx(block.flops_scale * expected[0], rel=1e-12)
        up_projected = cfg.num_heads * (2 * cfg.head_dim + cfg.v_head_dim)
        assert block.recomputable_width >= up_projected + block.hidden


def test_dualpipe_pairs_stage_i_with_pp_minus_1_minus_i(deepseek_v3_spec):
    profile = profile_model(deepseek_v3_spec)
    pp = random.choice((4, 8))
    cluster, workload = make_cluster("h800", 8 * pp), Workload(4096, 8 * 4 * pp)
    layout = stage_layout(profile, pp, 1, "balanced")
    knobs = dict(pp=pp, dp=8, ep=8, recompute=1)
    one = candidates(**knobs, schedule=SCHEDULES.index("1f1b"))
    dual = candidates(**knobs, schedule=SCHEDULES.index("dualpipe"))
    mm = MemoryModel()
    alone, paired = (memory_breakdown(profile, cluster, workload, c, layout, mm) for c in (one, dual))
    np.testing.assert_allclose(paired["parameters"][0], alone["parameters"][0] + alone["parameters"][0, ::-1])
    m = workload.global_batch // 8
    stage = np.arange(pp)
    act = alone["activations"][0] / np.minimum(m, pp - stage)  # one micro-batch of each stage's activations
    held = act * np.minimum(m / 2, pp - stage) + act[::-1] * np.minimum(m / 2, stage + 1)
    np.testing.assert_allclose(paired["activations"][0], held, rtol=1e-12)
    t1, t2 = (step_time(profile, cluster, workload, c, layout, MEGATRON) for c in (one, dual))
    assert t2["bubble"][0] < t1["bubble"][0]
    assert t2["pipeline"][0] == pytest.approx(m * t2["gpu_per_microbatch"][0] + t2["bubble"][0], rel=1e-12)
    with pytest.raises(BadInput, match="DualPipe"):  # fewer than 2 * pp micro-batches
        plan_parallel(
            deepseek_v3_spec, cluster, Workload(4096, 8 * pp), fixed=dict(tp=1, cp=1, zero=1, mbs=1, ep=8, pp=pp,
            schedule="dualpipe"), efficiency=MEGATRON,
        )  # fmt: skip


def test_the_deepseek_row_states_its_mechanisms():
    run = next(r for r in load_published_runs() if r.hf_config)
    assert run.published_tokens_per_s_per_gpu(None) == pytest.approx(
        1e12 / (run.reported_gpu_hours_per_trillion_tokens * 3600)
    )
    assert run.layout["schedule"] == "dualpipe" and run.layout["ep_overlap"] == 1
    eff, workload = run.efficiency(), run.workload()
    assert eff.ep_forwarded and eff.ep_fp8_dispatch and eff.moe_weighted_activation
    assert (workload.precision, workload.moment_bits, workload.act_cache_bits) == ("fp8", 16, 8)
    assert workload.mtp_depth == 1  # sec. 2.2: one multi-token-prediction module, which transformers does not build


def test_a_prediction_module_is_a_block_of_the_last_kind_and_a_head_pass_on_the_head_stage(deepseek_v3_spec):
    profile = profile_model(deepseek_v3_spec)
    depth = random.choice((1, 2))
    mtp = with_prediction_modules(profile, depth)
    last = int(profile.layer_types[-1])
    assert mtp.num_layers == profile.num_layers + depth and (mtp.layer_types[-depth:] == last).all()
    assert mtp.blocks[last].count == profile.blocks[last].count + depth and mtp.head_passes == 1 + depth
    projection = 2 * profile.hidden * profile.hidden  # [hidden; next token's embedding] -> hidden
    assert mtp.head_params == profile.head_params + depth * projection
    assert mtp.head_flops_per_token == (1 + depth) * profile.head_flops_per_token + depth * 2 * projection
    assert with_prediction_modules(profile, 0) is profile
    # planned: only the last stage gains work (its block, the projection and a head pass); the others are unchanged
    pp = 4
    cluster, fixed = make_cluster("h800", 8 * pp), dict(tp=1, pp=pp, dp=8, cp=1, ep=8, zero=1, mbs=1, recompute="full")
    plans = [
        plan_parallel(deepseek_v3_spec, cluster, Workload(4096, 8 * 4 * pp, mtp_depth=d), fixed=fixed, top_k=1).best
        for d in (0, depth)
    ]
    assert plans[1].step_time_s > plans[0].step_time_s
    # the head stage holds the module's block and a second set of logits
    workload, c = Workload(4096, 8 * 4 * pp), candidates(pp=pp, dp=8, ep=8, recompute=1)
    held = [
        memory_breakdown(prof, cluster, workload, c, stage_layout(prof, pp, 1, "balanced"), MemoryModel())
        for prof in (profile, mtp)
    ]
    assert held[1]["activations"][0, -1] > held[0]["activations"][0, -1]
    with pytest.raises(BadInput, match="multi-token-prediction"):
        Workload(4096, 64, mode="inference", mtp_depth=1)


def test_cli_states_the_precision_and_all_to_all_software(spec_json, capsys):
    argv = ["plan", str(spec_json), "--gpus", "8", "--gpu", "h100", "--seq", "2048", "--global-batch", "64"]
    argv += ["--fixed", "tp=1,pp=1,dp=8,cp=1,zero=1,recompute=none,mbs=1", "--top", "1", "--json"]
    states = {}
    for bits in (32, 16):
        assert main(argv + ["--precision", "fp8", "--act-cache-bits", "8", "--moment-bits", str(bits)]) == 0
        states[bits] = json.loads(capsys.readouterr().out)["plans"][0]["memory_breakdown"]["optimizer_states"]
    assert states[16] == pytest.approx(states[32] / 2, rel=1e-12)
    assert main(argv + ["--act-cache-bits", "8"]) == 2  # fp8-cached activations need fp8 GEMMs
    assert "--act-cache-bits" in capsys.readouterr().err
    for depth in ("9", "-1"):
        assert main(argv + ["--mtp-depth", depth]) == 2
        assert "--mtp-depth" in capsys.readouterr().err
    assert main(argv + ["--mtp-depth", "1"]) == 0
    capsys.readouterr()
    assert main(argv + ["--ep-comm", "forwarded", "--ep-fp8-dispatch", "--moe-weighted-activation"]) == 0
