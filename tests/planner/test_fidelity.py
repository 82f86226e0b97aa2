"""Memory-model fidelity against measurement, the Llama 3 pipeline split, HSDP, MoE imbalance, cold start."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from adapt.app.cli import main
from adapt.core.errors import BadInput
from parallel_planner.catalog import GIB
from parallel_planner.cluster import make_cluster
from parallel_planner.layout import FIELDS, Candidates, split_layers
from parallel_planner.memory import activation_bytes_per_block
from parallel_planner.profile import profile_model
from parallel_planner.published import load_published_runs, run_spec
from parallel_planner.search import plan_parallel
from parallel_planner.workload import Workload
from tests.planner.specs import decoder_spec


def _bytes_saved_for_backward(layer: torch.nn.Module, x: torch.Tensor, **kwargs) -> int:
    """Bytes autograd keeps for the layer's backward: distinct storages, parameters and inputs excluded."""
    excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    excluded |= {t.untyped_storage().data_ptr() for t in kwargs["position_embeddings"]}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, **kwargs)
    return sum(storages.values())


def _planner_block_bytes(spec, seq: int, fused_kernels: bool) -> float:
    """memory.py's saved activations of one block at TP=1, no SP, one sequence of ``seq`` tokens."""
    row = dict.fromkeys(FIELDS, 1) | dict(zero=1, recompute=0, schedule=0, offload=0, split=0)
    one = Candidates.from_rows([tuple(row[f] for f in FIELDS)])
    return float(activation_bytes_per_block(profile_model(spec), Workload(seq, 1), one, fused_kernels)[0, 0])


def _measure(config, layer_cls, rope_cls, seq: int) -> int:
    config._attn_implementation = "sdpa"  # on GPU this is flash attention: q, k, v, output and lse are kept
    layer = layer_cls(config, 0).to(torch.bfloat16)
    x = torch.randn(1, seq, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(seq)[None]
    cos_sin = rope_cls(config)(x, position_ids)
    from parallel_planner.spec_worker import one_intra_op_thread

    with one_intra_op_thread():  # small GEMMs: threads only contend on a shared machine
        return _bytes_saved_for_backward(
            layer, x, position_embeddings=cos_sin, attention_mask=None, position_ids=position_ids
        )


def test_activation_model_matches_bytes_saved_by_a_gqa_swiglu_layer():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    h, f, heads, kv, seq = 1024, 2816, 16, 4, 128
    config = LlamaConfig(
        hidden_size=h,
        intermediate_size=f,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=1,
        vocab_size=128,
    )
    measured = _measure(config, LlamaDecoderLayer, LlamaRotaryEmbedding, seq)
    spec = decoder_spec(layers=1, hidden=h, ffn=f, heads=heads, kv_heads=kv, seq=seq)
    eager = _planner_block_bytes(spec, seq, fused_kernels=False)
    assert eager == pytest.approx(measured, rel=0.05)
    # Fused kernels keep a norm's bf16 input (not an fp32 copy and the normalised tensor) and recompute SiLU.
    fused = _planner_block_bytes(spec, seq, fused_kernels=True)
    assert eager - fused == pytest.approx(2 * seq * (2 * 2 * h + f), rel=1e-12)


def test_activation_model_matches_bytes_saved_by_an_moe_layer(tmp_path):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding

    from adapt.model.intake import inspect

    seq = 256
    config = MixtralConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=128,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    config.save_pretrained(tmp_path)
    spec = inspect(str(tmp_path), config_only=True, seq_len=seq)  # the spec intake derives, not one written here
    measured = _measure(config, MixtralDecoderLayer, MixtralRotaryEmbedding, seq)
    # The routed part depends on the router only through the top-k total, which is fixed; one rank holding
    # every expert sees no load imbalance.
    assert _planner_block_bytes(spec, seq, fused_kernels=False) == pytest.approx(measured, rel=0.05)


def test_light_ends_can_give_the_end_chunks_only_the_embedding_and_the_head():
    assert split_layers(126, 128, "light_ends") == [0] + [1] * 126 + [0]
    assert split_layers(126, 128, "balanced") is None
    assert split_layers(8, 4, "light_ends") == [1, 3, 3, 1]
    assert split_layers(2, 4, "light_ends") == [0, 1, 1, 0]
    assert split_layers(1, 4, "light_ends") is None  # a middle chunk would be empty
    # Llama 3 405B as its paper pipelines it: 16 stages, the first and last one layer lighter, 8 chunks each.
    run = next(r for r in load_published_runs() if r.source == "llama3" and r.gpus == 8192)
    best = plan_parallel(
        run_spec(run),
        make_cluster(run.gpu, run.gpus),
        run.workload(),
        fixed=dict(run.layout, vpp=8, split="light_ends", mbs=1),
        top_k=1,
    ).best
    chunks = np.array(best.plan.stage_layers).reshape(8, 16)  # chunk j runs on stage j % 16
    assert chunks.sum(axis=0).tolist() == [7] + [8] * 14 + [7]
    assert best.plan.stage_layers[0] == best.plan.stage_layers[-1] == 0


def test_hsdp_shards_states_over_one_group_and_reduces_across_replicas():
    spec = decoder_spec(layers=16, hidden=4096, ffn=14336, heads=32, kv_heads=8)
    cluster, workload = make_cluster("h100", 256), Workload(4096, 512)
    knobs = dict(tp=1, pp=1, dp=256, cp=1, zero=3, recompute="full", mbs=1, split="balanced")
    flat = plan_parallel(spec, cluster, workload, fixed=dict(knobs, replicate=1), top_k=1).best
    hsdp = plan_parallel(spec, cluster, workload, fixed=dict(knobs, replicate=32), top_k=1).best
    assert (hsdp.plan.dp_replicate, hsdp.plan.dp_shard) == (32, 8) and hsdp.plan.validate() == []
    for state in ("parameters", "gradients", "optimizer_states"):  # sharded over 8 ranks instead of 256
        assert hsdp.memory_breakdown[state] == pytest.approx(32 * flat.memory_breakdown[state], rel=1e-12)
    # ZeRO-3 gathers every micro-batch: inside a node instead of over 256 ranks' latency, which dominates
    # for a small model (a flat ring over whole nodes has every member's NIC, so bandwidth alone does not).
    small = decoder_spec(layers=8, hidden=1024, ffn=4096, heads=16, kv_heads=4)
    flat = plan_parallel(small, cluster, workload, fixed=dict(knobs, replicate=1), top_k=1).best
    hsdp = plan_parallel(small, cluster, workload, fixed=dict(knobs, replicate=32), top_k=1).best
    assert hsdp.time_breakdown["data_parallel_exposed"] < flat.time_breakdown["data_parallel_exposed"]
    searched = plan_parallel(small, cluster, workload, fixed=knobs, top_k=1).best
    assert searched.plan.dp_replicate > 1 and searched.step_time_s <= hsdp.step_time_s
    with pytest.raises(BadInput, match="no valid layout"):  # HSDP with context parallelism is not realised
        plan_parallel(spec, cluster, workload, fixed=dict(knobs, dp=128, cp=2, replicate=16))


def test_moe_imbalance_slows_experts_and_all_to_all_and_fills_the_busiest_rank():
    from adapt.core.spec import MLPSpec

    h, f, experts, top_k = 1024, 1408, 16, 2
    dense = decoder_spec(layers=4, hidden=h, ffn=f)  # unaffected by the knob
    blocks = []
    for b in dense.blocks:  # the same decoder with 16 routed experts of width f, top-2
        routed = experts * 3 * h * f
        blocks.append(
            dataclasses.replace(
                b,
                mlp=MLPSpec(kind="moe", intermediate_size=f, activation="silu", num_experts=experts, top_k=top_k),
                params=b.params - 3 * h * f + routed + h * experts,
                params_active=b.params - 3 * h * f + top_k * 3 * h * f + h * experts,
                linear_flops_per_token=b.linear_flops_per_token + (top_k - 1) * 6 * h * f + 2 * h * experts,
            )
        )
    moe = dataclasses.replace(dense, blocks=blocks)
    fixed = dict(tp=1, pp=1, dp=16, cp=1, ep=8, zero=1, recompute="none", mbs=1, replicate=1)

    def plan(spec, imbalance):
        return plan_parallel(
            spec,
            make_cluster("h100", 16),
            Workload(4096, 64, moe_imbalance=imbalance),
            fixed=fixed if spec is moe else dict(fixed, ep=1),
            top_k=1,
        ).best

    even, skewed = plan(moe, 1.0), plan(moe, 1.2)
    assert skewed.time_breakdown["compute_per_microbatch"] > even.time_breakdown["compute_per_microbatch"]
    assert skewed.time_breakdown["exposed_comm_per_microbatch"] > even.time_breakdown["exposed_comm_per_microbatch"]
    assert skewed.memory_breakdown["activations"] > even.memory_breakdown["activations"]
    assert plan(dense, 1.0).step_time_s == plan(dense, 1.2).step_time_s
    with pytest.raises(BadInput, match="moe-imbalance"):
        Workload(4096, 64, moe_imbalance=0.5)


def test_cold_spec_from_the_worker_is_the_in_process_spec(deepseek_v3_dir, deepseek_v3_spec, tmp_path):
    from adapt.core.source import resolve_source
    from parallel_planner.spec_worker import _answer, describe, describe_in_worker

    src = resolve_source(str(deepseek_v3_dir), config_only=True)
    in_process = describe(src, 4096)  # one intra-op thread for the probes
    assert describe_in_worker(src, 4096).to_dict() == in_process.to_dict() == deepseek_v3_spec.to_dict()
    # What the worker answers for a checkpoint intake refuses: the message and exit code of the BadInput.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_architecture", "hidden_size": 8}))
    request = json.loads(json.dumps({"source": dataclasses.asdict(resolve_source(str(tmp_path))), "seq_len": 64}))
    answer = _answer(request)
    assert answer["exit_code"] == 2 and "unknown architecture" in answer["error"] and "spec" not in answer


def test_cli_moe_imbalance_and_hsdp_in_the_json(spec_json, capsys):
    argv = [
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
        "--fixed",
        "tp=1,pp=1,dp=64,cp=1,zero=3,replicate=8",
        "--top",
        "1",
        "--json",
    ]
    assert main(argv) == 0
    entry = json.loads(capsys.readouterr().out)["plans"][0]
    assert (
        (entry["dp_replicate"], entry["dp_shard"])
        == (8, 8)
        == (entry["plan"]["dp_replicate"], entry["plan"]["dp_shard"])
    )
    assert entry["memory_gib_per_gpu"] * GIB > 0
    assert main(argv + ["--moe-imbalance", "0.9"]) == 2
    assert "moe-imbalance" in capsys.readouterr().err
