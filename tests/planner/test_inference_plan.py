"""Inference plans: KV-cache budget, concurrency, time per output token and vLLM settings, from dimensions."""

from __future__ import annotations

import json

import pytest

from adapt.app.cli import main
from parallel_planner.catalog import GIB
from parallel_planner.cluster import make_cluster
from parallel_planner.efficiency import Efficiency
from parallel_planner.inference import ServingWorkload, plan_inference


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory):
    """Llama-3.2-1B's shape, config-only: 16 layers, 8 KV heads of 64, tied 128256 vocabulary."""
    from transformers import LlamaConfig

    from adapt.model.intake import inspect

    path = tmp_path_factory.mktemp("llama1b")
    LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, tie_word_embeddings=True, head_dim=64).save_pretrained(path)  # fmt: skip
    return path, inspect(str(path), config_only=True)


@pytest.fixture(scope="module")
def gemma2_2b(tmp_path_factory):
    from transformers import Gemma2Config

    from adapt.model.intake import inspect

    path = tmp_path_factory.mktemp("gemma2b")
    Gemma2Config(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=256, vocab_size=256000, sliding_window=4096).save_pretrained(path)  # fmt: skip
    return inspect(str(path), config_only=True)


def by_layout(result):
    return {(p.tp, p.pp, p.ep): p for p in result.plans}


def test_kv_cache_per_sequence_and_tp_split(llama_1b):
    _, spec = llama_1b
    result = plan_inference(spec, make_cluster("h200", 8), ServingWorkload(8192, 16), top_k=100)
    plans = by_layout(result)
    per_token = 16 * 2 * 8 * 64 * 2  # layers x (K, V) x kv heads x head dim x bf16
    assert plans[(1, 1, 1)].kv_gib_per_sequence == pytest.approx(per_token * 8192 / GIB)
    assert plans[(2, 1, 1)].kv_gib_per_sequence == pytest.approx(per_token * 8192 / GIB / 2)
    assert plans[(1, 2, 1)].kv_gib_per_sequence == pytest.approx(
        per_token * 8192 / GIB / 2
    )  # half the layers per stage
    assert plans[(1, 1, 1)].memory_breakdown["weights"] == pytest.approx(spec.params.total * 2 / GIB, rel=0.01)


def test_max_sequences_follow_the_memory_left_and_decide_the_fit(llama_1b):
    _, spec = llama_1b
    one = make_cluster("h200", 1)
    fitting = plan_inference(spec, one, ServingWorkload(131072, 8)).best
    budget = fitting.memory_breakdown["kv_budget"]
    assert fitting.max_concurrent_sequences == int(budget // fitting.kv_gib_per_sequence)
    too_many = plan_inference(spec, one, ServingWorkload(131072, fitting.max_concurrent_sequences + 1)).best
    assert not too_many.fits and "needed" in too_many.why_not
    assert fitting.vllm["--max-model-len"] == 131072 and fitting.vllm["--gpu-memory-utilization"] == 0.9


def test_time_per_token_is_bytes_over_bandwidth_at_batch_one(llama_1b):
    _, spec = llama_1b
    cluster, eff = make_cluster("h200", 1), Efficiency()
    plan = plan_inference(spec, cluster, ServingWorkload(4096, 1), efficiency=eff).best
    kv = 16 * 2 * 8 * 64 * 2 * 4096
    bytes_read = spec.params.total * 2 + kv  # tied head: the embedding matrix is read once, as the head
    assert plan.time_breakdown["memory_s"] == pytest.approx(
        bytes_read / (cluster.gpu.hbm_gbps * 1e9 * eff.memory_bw), rel=0.02
    )
    assert plan.time_breakdown["compute_s"] < plan.time_breakdown["memory_s"]  # decode at batch 1 is bandwidth-bound
    assert plan.time_per_output_token_s >= plan.time_breakdown["memory_s"]


def test_tensor_parallelism_trades_bandwidth_for_all_reduces(llama_1b):
    _, spec = llama_1b
    plans = by_layout(plan_inference(spec, make_cluster("h200", 8), ServingWorkload(4096, 8), top_k=100))
    assert plans[(8, 1, 1)].time_breakdown["memory_s"] < plans[(1, 1, 1)].time_breakdown["memory_s"] / 4
    assert plans[(8, 1, 1)].time_breakdown["tp_comm_s"] > 0 == plans[(1, 1, 1)].time_breakdown["tp_comm_s"]
    assert plans[(8, 1, 1)].vllm["--tensor-parallel-size"] == 8 and "--data-parallel-size" not in plans[(8, 1, 1)].vllm
    assert plans[(1, 1, 1)].vllm["--data-parallel-size"] == 8


def test_sliding_window_layers_cap_their_cache(gemma2_2b):
    plan = plan_inference(gemma2_2b, make_cluster("h200", 1), ServingWorkload(32768, 1)).best
    per_token_layer = 2 * 4 * 256 * 2
    windowed = [b.attention.window for b in gemma2_2b.blocks]
    expected = sum(per_token_layer * min(32768, w or 32768) for w in windowed)
    assert any(windowed) and plan.kv_gib_per_sequence == pytest.approx(expected / GIB)


def test_mla_latent_is_not_split_by_tensor_parallelism(deepseek_v3_spec):
    plans = by_layout(
        plan_inference(deepseek_v3_spec, make_cluster("h200", 16, 8), ServingWorkload(4096, 8), top_k=200)
    )
    assert plans[(8, 2, 8)].kv_gib_per_sequence == pytest.approx(plans[(8, 2, 1)].kv_gib_per_sequence)
    one_stage = [p for p in plans.values() if p.pp == 2]
    assert len({round(p.kv_gib_per_sequence, 9) for p in one_stage}) == 1  # the latent is on every TP rank
    assert plans[(8, 2, 8)].vllm["--enable-expert-parallel"] is True


def test_cli_prints_one_json_plan_and_rejects_train_only_flags(llama_1b, capsys):
    path, _ = llama_1b
    assert main(["plan", str(path), "--config-only", "--mode", "inference", "--gpu", "h200", "--gpus", "2", "--seq", "4096",
                 "--concurrency", "32", "--json", "--no-cache"]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "inference" and data["plans"][0]["vllm"]["--max-model-len"] == 4096
    assert (
        main(
            ["plan", str(path), "--config-only", "--gpu", "h200", "--gpus", "2", "--seq", "4096", "--concurrency", "32"]
        )
        == 2
    )
    assert "--concurrency is for --mode inference" in capsys.readouterr().err
