"""Search: optimality against brute force, constraints, MoE/MLA, bad input, the CLI contract."""

from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest

from adapt.app.cli import main
from adapt.core.errors import BadInput
from parallel_planner.cluster import (
    cluster_from_environment,
    load_cluster_file,
    make_cluster,
)
from parallel_planner.plan import ParallelPlan
from parallel_planner.search import plan_parallel
from parallel_planner.workload import Workload
from tests.planner.specs import decoder_spec


def test_search_beats_every_brute_forced_layout():
    """The ranked best is at least as fast as any fitting layout evaluated one by one."""
    spec = decoder_spec(layers=8, hidden=2048, ffn=5632, heads=16, kv_heads=8)
    cluster, workload = make_cluster("a100", 16), Workload(4096, 32)
    result = plan_parallel(spec, cluster, workload, top_k=3)
    best = result.best
    steps = [p.step_time_s for p in result.plans]
    assert steps == sorted(steps) and all(p.fits for p in result.plans)
    fastest_seen = np.inf
    for tp, pp, cp in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2)):
        dp = 16 // (tp * pp * cp)
        if dp < 1 or tp * pp * cp * dp != 16:
            continue
        for zero, rec, mbs in itertools.product((0, 1, 3), ("none", "full"), (1, 2)):
            fixed = dict(
                tp=tp, pp=pp, dp=dp, cp=cp, zero=zero, recompute=rec, mbs=mbs, vpp=1, schedule="1f1b", split="balanced"
            )
            plan = plan_parallel(spec, cluster, workload, fixed=fixed, top_k=1).best
            if plan.fits:
                fastest_seen = min(fastest_seen, plan.step_time_s)
    assert np.isfinite(fastest_seen)
    assert best.step_time_s <= fastest_seen * (1 + 1e-12)
    # Re-evaluating the winner with every knob pinned reproduces its prediction.
    p = best.plan
    pinned = dict(
        tp=p.tp,
        pp=p.pp,
        dp=p.dp,
        cp=p.cp,
        ep=p.ep,
        zero=p.zero,
        recompute=p.recompute,
        mbs=p.micro_batch,
        vpp=p.vpp,
        schedule=p.pp_schedule,
        offload=int(p.offload_optimizer),
    )
    again = plan_parallel(spec, cluster, workload, fixed=pinned, top_k=1).best
    assert again.step_time_s == pytest.approx(best.step_time_s, rel=1e-12)


def test_deepseek_v3_on_2048_h800_respects_every_constraint(deepseek_v3_spec):
    spec = deepseek_v3_spec
    cluster = make_cluster("h800", 2048)
    result = plan_parallel(spec, cluster, Workload(4096, 15360), top_k=5)
    assert result.searched > 10_000 and result.binding_constraint
    for ranked in result.plans:
        p = ranked.plan
        assert p.validate() == []
        assert p.world_size == 2048 and p.tp <= 8 and p.tp * p.ep <= 8
        assert 128 % p.tp == 0 and 256 % p.ep == 0 and (p.dp * p.cp) % p.ep == 0
        assert ranked.fits and ranked.memory_gib_per_gpu <= ranked.usable_memory_gib
        assert sum(p.stage_layers or [61]) == 61 and len(p.stage_layers or [0]) in (1, p.pp * p.vpp)
        assert 0 < ranked.mfu < 1 and ranked.tokens_per_s > 0
    # The published DeepSeek-V3 layout (PP16, EP64 over 8 nodes, ZeRO-1, no TP) fits and is no faster than the search.
    published = plan_parallel(
        spec, cluster, Workload(4096, 15360), fixed="tp=1,pp=16,dp=128,cp=1,ep=64,zero=1", top_k=1
    )
    assert published.best.fits
    assert result.best.tokens_per_s >= published.best.tokens_per_s


def test_tiny_moe_mla_checkpoint_plans(zoo):
    from adapt.model.intake import inspect

    spec = inspect(str(zoo("deepseek_v3")))
    result = plan_parallel(spec, make_cluster("h100", 8), Workload(256, 64), top_k=2)
    assert result.best.fits and result.best.plan.world_size == 8


def test_memory_binds_for_a_big_model_on_few_gpus():
    spec = decoder_spec(layers=32, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256)
    result = plan_parallel(spec, make_cluster("h100", 64), Workload(8192, 64), top_k=1)
    assert result.binding_constraint.startswith("memory")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda s: plan_parallel(s, make_cluster("v100", 8), Workload(2048, 8)), "not in the catalogue"),
        (lambda s: plan_parallel(s, make_cluster("h100", 4096), Workload(2048, 4)), "global batch"),
        (lambda s: plan_parallel(s, make_cluster("a100", 8), Workload(2048, 8, precision="fp8")), "fp8"),
        (lambda s: plan_parallel(s, make_cluster("h100", 8), Workload(2048, 8), fixed="tp=3"), "does not lay out"),
        (lambda s: plan_parallel(s, make_cluster("h100", 8), Workload(2048, 8), fixed="warp=2"), "unknown key"),
        (lambda s: plan_parallel(s, make_cluster("h100", 12, 8), Workload(2048, 8)), "whole nodes"),
    ],
)
def test_impossible_requests_are_bad_input(make, message):
    with pytest.raises(BadInput, match=message):
        make(decoder_spec())


def test_nothing_fits_names_the_smallest_need():
    spec = decoder_spec(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256)
    with pytest.raises(BadInput, match="no layout fits"):
        plan_parallel(spec, make_cluster("a100", 1), Workload(65536, 1))
    # With ZeRO-3 and optimizer offload the same model squeezes onto one GPU at 4K: slowly, over PCIe.
    squeezed = plan_parallel(spec, make_cluster("a100", 1), Workload(4096, 1), top_k=1)
    assert squeezed.best.plan.offload_optimizer and squeezed.notes
    assert squeezed.best.time_breakdown["data_parallel_exposed"] > 1.0  # weights stream over PCIe each pass


def test_cluster_files_and_local_machine(tmp_path):
    (tmp_path / "c.yaml").write_text("gpu: h100\ngpus: 64\noverrides:\n  inter_node_gbps: 25\n")
    cluster = load_cluster_file(tmp_path / "c.yaml")
    assert cluster.num_gpus == 64 and cluster.gpu.inter_node_gbps == 25 and cluster.gpus_per_node == 8
    (tmp_path / "c.toml").write_text(
        'gpus = 16\ngpus_per_node = 4\n[gpu]\nname = "x1"\nmemory_gib = 96\nbf16_tflops = 500\nfp8_tflops = 0\n'
        "hbm_gbps = 3000\nintra_node_gbps = 300\ninter_node_gbps = 50\ngpus_per_node = 4\ngemm_ceiling = 0.7\n"
    )
    custom = load_cluster_file(tmp_path / "c.toml")
    assert custom.gpu.name == "x1" and custom.num_nodes == 4
    (tmp_path / "bad.yaml").write_text("gpu: h100\n")
    with pytest.raises(BadInput, match="'gpu' and 'gpus'"):
        load_cluster_file(tmp_path / "bad.yaml")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(BadInput, match="no GPU"):
            from adapt.app.clusters import local_cluster

            local_cluster()
    # What the environment stage reported on one H200 (anchors: 4,274 GB/s copy, ~684 TFLOP/s bf16 matmul).
    env = {
        "device_type": "cuda",
        "devices": [{"name": "NVIDIA H200", "memory_bytes": 150_000_000_000}],
        "copy_gbps": 4274.0,
        "matmul_tflops": 684.0,
        "matmul_dtype": "bfloat16",
        "allreduce_gbps": None,
    }
    measured = cluster_from_environment(env)
    assert measured.gpu.name == "h200" and measured.num_gpus == 1
    assert measured.gpu.gemm_ceiling == pytest.approx(684 / 989) and measured.gpu.hbm_gbps == 4274.0
    assert measured.gpu.memory_bytes == 150_000_000_000


def test_cli_json_contract(spec_json, capsys):
    code = main(
        [
            "plan",
            str(spec_json),
            "--gpus",
            "64",
            "--gpu",
            "h100",
            "--seq",
            "4096",
            "--global-batch",
            "256",
            "--top",
            "3",
            "--json",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["plans"]) == 3 and data["binding_constraint"]
    for entry in data["plans"]:
        for key in (
            "tp",
            "pp",
            "dp",
            "cp",
            "ep",
            "zero",
            "recompute",
            "micro_batch",
            "memory_gib_per_gpu",
            "memory_breakdown",
            "step_time_s",
            "tokens_per_s",
            "mfu",
            "hfu",
            "torchrun",
            "plan",
        ):
            assert key in entry
        plan = ParallelPlan.from_dict(entry["plan"])
        assert plan.validate() == [] and plan.world_size == 64
        assert sum(entry["memory_breakdown"].values()) == pytest.approx(entry["memory_gib_per_gpu"], rel=1e-9)
        assert entry["tokens_per_s"] == pytest.approx(256 * 4096 / entry["step_time_s"], rel=1e-9)


def test_cli_fixed_layout_that_does_not_fit_exits_2(spec_json, capsys):
    code = main(
        [
            "plan",
            str(spec_json),
            "--gpus",
            "8",
            "--gpu",
            "a100",
            "--seq",
            "32768",
            "--global-batch",
            "64",
            "--fixed",
            "tp=1,pp=1,dp=8,zero=0,recompute=none,mbs=8",
        ]
    )
    assert code == 2
    assert "does not fit" in capsys.readouterr().err


def test_cli_rejects_unknown_gpu_and_too_many_gpus(spec_json, capsys):
    assert main(["plan", str(spec_json), "--gpus", "8", "--gpu", "tpu9", "--seq", "2048", "--global-batch", "8"]) == 2
    assert "not in the catalogue" in capsys.readouterr().err
    assert (
        main(["plan", str(spec_json), "--gpus", "16384", "--gpu", "h100", "--seq", "2048", "--global-batch", "8"]) == 2
    )
    assert "no valid layout" in capsys.readouterr().err


def test_cli_config_source_is_cached_and_tokens_batch_accepted(zoo, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ADAPT_CACHE_DIR", str(tmp_path / "cache"))
    argv = [
        "plan",
        str(zoo("qwen3_moe")),
        "--gpus",
        "8",
        "--gpu",
        "h200",
        "--seq",
        "256",
        "--global-batch-tokens",
        str(64 * 256),
        "--top",
        "1",
        "--json",
    ]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(list((tmp_path / "cache" / "specs").glob("*.json"))) == 1
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["plans"][0]["step_time_s"] == first["plans"][0]["step_time_s"]
    assert first["workload"]["global_batch"] == 64
    # the same checkpoint elsewhere hits the cache, and the launch line names where it is now
    moved = tmp_path / "moved"
    shutil.copytree(zoo("qwen3_moe"), moved)
    assert main(["plan", str(moved), "--gpus", "8", "--gpu", "h200", "--seq", "256", "--top", "1"]) == 0
    launch = capsys.readouterr().out.replace("\n", "")
    assert str(moved) in launch and str(zoo("qwen3_moe")) not in launch
    assert len(list((tmp_path / "cache" / "specs").glob("*.json"))) == 1


def test_fp8_speeds_up_gemms_but_mfu_stays_over_bf16_peak():
    spec = decoder_spec(layers=16, hidden=4096, ffn=14336, heads=32, kv_heads=8)
    fixed = "tp=1,pp=1,dp=8,cp=1,zero=1,recompute=none,mbs=1"
    bf16 = plan_parallel(spec, make_cluster("h100", 8), Workload(4096, 64), fixed=fixed, top_k=1).best
    fp8 = plan_parallel(spec, make_cluster("h100", 8), Workload(4096, 64, precision="fp8"), fixed=fixed, top_k=1).best
    assert fp8.step_time_s < bf16.step_time_s
    assert fp8.mfu / bf16.mfu == pytest.approx(bf16.step_time_s / fp8.step_time_s, rel=1e-9)
