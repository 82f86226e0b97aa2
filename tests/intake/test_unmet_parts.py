"""Parts intake and the operators stage had not met: layers that attend to another layer's K/V
(cross-layer KV sharing), layers that hand their successor a state (a tuple, not a bare hidden state), windows
kept on full-attention layers, a new component whose data-dependent loops Dynamo cannot capture whole, and
attention scores computed with ``baddbmm``.

transformers' Kolibri 1.1 has the first four, Gemma 4 the shared-KV tail, GPT-NeoX-Japanese the last; each test is
skipped on a transformers without the model type.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

from adapt.model.intake import build_spec, resolve_source
from operators.api import run_ops
from parallel_planner.profile import profile_model

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _save(tmp_path, model_type: str, **settings):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        **settings,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a router left at zero ties every choice: no trained checkpoint does
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(0.0, 0.02)
    model.save_pretrained(tmp_path / model_type)
    return tmp_path / model_type


def _kolibri(tmp_path):
    """Sliding layers 0 and 3; indexed layers 1 (an indexer), 2 and 4 (reading layer 1's K/V, 4 an indexer too)."""
    return _save(
        tmp_path,
        "kolibri1_1",
        num_hidden_layers=5,
        sliding_window=16,
        layer_types=["sliding_attention", "indexed_attention", "indexed_attention"]
        + ["sliding_attention"]
        + ["indexed_attention"],
        index_layers=[1, 4],
        kv_source_layers=[0, 1, 1, 3, 1],
        index_topk=8,
        index_pool_size=32,
        index_compression=4,
        index_num_heads=2,
        index_num_local_tokens=4,
        index_num_sink_tokens=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        mlp_only_intermediate_size=96,
    )


def _kv_bytes(layers: int, dtype_bytes: int = 4) -> int:
    return layers * KV_HEADS * 2 * HEAD_DIM * dtype_bytes


def test_layers_that_read_another_layers_kv_hold_no_cache_and_keep_their_kv_heads(tmp_path):
    spec = build_spec(resolve_source(str(_kolibri(tmp_path))))
    attention = [b.attention for b in spec.blocks]
    assert [a.kv_shared for a in attention] == [False, False, True, False, True]
    # only a query projection: read before as fused q/k/v with one KV head (MQA)
    assert {(a.kind, a.num_heads, a.num_kv_heads) for a in attention} == {("gqa", HEADS, KV_HEADS)}
    assert spec.cost.kv_cache_bytes_per_token == _kv_bytes(3)
    assert any("cross-layer KV sharing: 2/5 blocks" in f for f in spec.features)
    profile = profile_model(spec)
    # the planner's serving and memory terms: the distinct blocks' cached widths, by how many blocks each stands for
    assert sum(b.kv_cache_width * b.count for b in profile.blocks) == 3 * KV_HEADS * 2 * HEAD_DIM
    assert min(b.kv_cache_width for b in profile.blocks) == 0


def test_a_window_kept_on_a_full_layer_is_no_window(tmp_path):
    """Kolibri's attention stores ``sliding_window`` on every layer and says which slide with ``is_sliding``."""
    spec = build_spec(resolve_source(str(_kolibri(tmp_path))))
    assert [b.attention.window for b in spec.blocks] == [16, None, None, 16, None]
    assert [b.mixer for b in spec.blocks] == ["sliding_attention", "full_attention", "full_attention"] + [
        "sliding_attention",
        "full_attention",
    ]


def test_the_router_is_measured_in_blocks_whose_attention_cannot_run_on_meta_tensors(tmp_path):
    """The indexer's data-dependent loops fail on the meta skeleton, and every layer returns a (hidden, pool) tuple:
    the blocks after it must still run, and the MoE child measured in one block describes the same child in others.
    Kolibri's router scores with a sigmoid after its top-k; the config does not say so."""
    spec = build_spec(resolve_source(str(_kolibri(tmp_path))))
    moe = [b.mlp for b in spec.blocks if b.mlp.kind == "moe"]
    assert len(moe) == 4
    assert {(m.router_scoring, m.top_k) for m in moe} == {("sigmoid", 2)}


def test_a_new_component_dynamo_cannot_capture_whole_runs_as_traced(tmp_path):
    report = run_ops(str(_kolibri(tmp_path)), onnx=False)
    indexers = [c for c in report.plan.components if c.module.endswith("self_attn.indexer")]
    assert [c.module for c in indexers] == [f"model.layers.{i}.self_attn.indexer" for i in (1, 2, 4)]
    for choice in indexers:
        assert (choice.status, choice.kernel, choice.patch) == ("native", "as traced", False)
        assert "Inductor cannot compile it as one graph" in choice.note
    assert not [g for g in report.generated if g.module.endswith("indexer")]
    assert report.patch_check.ran and report.patch_check.passed


def test_a_shared_kv_tail_caches_only_the_layers_that_produce_it(tmp_path):
    """Gemma 4's last ``num_kv_shared_layers`` reuse the K/V of the last earlier layer of their type."""
    kinds = ["sliding_attention"] * 3 + ["full_attention"]
    ckpt = _save(
        tmp_path,
        "gemma4_text",
        num_hidden_layers=8,
        sliding_window=16,
        layer_types=kinds * 2,
        num_kv_shared_layers=4,
        intermediate_size=96,
        global_head_dim=HEAD_DIM,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=256,
    )
    spec = build_spec(resolve_source(str(ckpt)))
    assert [b.attention.kv_shared for b in spec.blocks] == [False] * 4 + [True] * 4
    assert {b.attention.num_kv_heads for b in spec.blocks} == {KV_HEADS}
    assert spec.cost.kv_cache_bytes_per_token == _kv_bytes(4)


def test_scores_computed_with_baddbmm_are_an_attention_core_not_a_recurrence(tmp_path):
    """GPT-NeoX-Japanese scores with ``baddbmm`` (zeros plus q k^T) and slices q/k/v and their rotary halves nine
    times: with the core unseen, the slices read as a loop over the positions, and every block as recurrent."""
    ckpt = _save(tmp_path, "gpt_neox_japanese", num_hidden_layers=2, intermediate_size=128)
    spec = build_spec(resolve_source(str(ckpt)))
    assert [b.mixer for b in spec.blocks] == ["full_attention"] * 2
    assert {(b.attention.kind, b.attention.num_heads, b.attention.head_dim) for b in spec.blocks} == {
        ("mha", HEADS, HEAD_DIM)
    }
    assert spec.cost.kv_cache_bytes_per_token == 2 * HEADS * 2 * HEAD_DIM * 4


def _projection_flops(module: torch.nn.Module) -> int:
    return 2 * sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def test_a_linear_attention_keeps_a_state_not_keys(tmp_path):
    """MiniMax's lightning attention computes q k^T too, but contracts k^T v over the positions into a state: its
    layers are recurrent, cache no keys, and their projections still count as per-token FLOPs."""
    ckpt = _save(
        tmp_path,
        "minimax",
        num_hidden_layers=4,
        layer_types=["full_attention", "linear_attention"] * 2,
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    spec = build_spec(resolve_source(str(ckpt)))
    assert [b.mixer for b in spec.blocks] == ["full_attention", "recurrent"] * 2
    assert [b.attention is None for b in spec.blocks] == [False, True] * 2
    assert spec.cost.kv_cache_bytes_per_token == _kv_bytes(2)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    full, lightning = model.model.layers[0], model.model.layers[1]
    # the two layer kinds differ only in their token mixer: so do their FLOPs
    assert spec.blocks[1].linear_flops_per_token - spec.blocks[0].linear_flops_per_token == _projection_flops(
        lightning.self_attn
    ) - _projection_flops(full.self_attn)


def test_a_state_space_mixers_projections_count_as_flops(tmp_path):
    """Mamba's in, x, dt and out projections run on every token: before, its blocks counted only what no mixer
    owned, a sixteenth of their FLOPs."""
    ckpt = _save(tmp_path, "mamba", num_hidden_layers=2, state_size=8, intermediate_size=128)
    spec = build_spec(resolve_source(str(ckpt)))
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert [b.mixer for b in spec.blocks] == ["recurrent"] * 2
    assert [b.linear_flops_per_token for b in spec.blocks] == [
        _projection_flops(layer) for layer in model.backbone.layers
    ]


def test_a_feed_forward_only_layer_mixes_no_tokens(tmp_path):
    """Nemotron-H interleaves layers that hold only an MLP (or only experts) with its mixers: such a layer has no
    token mixer to identify, and is no novelty."""
    try:
        ckpt = _save(
            tmp_path,
            "nemotron_h",
            num_hidden_layers=2,
            layers_block_type=["full_attention", "mlp"],
            intermediate_size=128,
        )
    except (TypeError, ValueError) as err:  # a transformers that names the layer schedule otherwise
        pytest.skip(f"nemotron_h takes no layers_block_type here: {err}")
    spec = build_spec(resolve_source(str(ckpt)))
    assert [b.mixer for b in spec.blocks] == ["full_attention", "none"]
    assert [b.mlp.kind for b in spec.blocks] == ["none", "dense_plain"]
    assert not [n for n in spec.novelties if "token mixer" in n]


def test_an_rnn_with_token_shift_vectors_is_recurrent_without_experts(tmp_path):
    """RWKV keeps its token-shift mixing weights as (1, 1, width) parameters, and its feed-forward gates with a square
    projection: read before as one-expert banks and an MQA attention with a KV cache."""
    ckpt = _save(tmp_path, "rwkv", num_hidden_layers=2, attention_hidden_size=64, intermediate_size=128)
    spec = build_spec(resolve_source(str(ckpt)))
    assert [b.mixer for b in spec.blocks] == ["recurrent"] * 2
    assert [b.attention for b in spec.blocks] == [None, None]
    assert {(b.mlp.kind, b.mlp.intermediate_size) for b in spec.blocks} == {("dense_gated", 128)}
    assert spec.cost.kv_cache_bytes_per_token == 0


def test_side_paths_beside_the_attention_and_the_feed_forward_are_neither(tmp_path):
    """Gemma 3n's layer holds, beside its attention and gated MLP, a low-rank residual block (LAUReL: width -> rank ->
    width, an MLP by shape), an AltUp predictor and router (small matrices off the width) and a per-layer input gate
    and projection on the layer itself. Merged into the MLP and the attention they read as a rank-wide plain MLP and
    a multi-head latent attention."""
    ckpt = _save(
        tmp_path,
        "gemma3n_text",
        num_hidden_layers=2,
        intermediate_size=128,
        laurel_rank=8,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=256,
        num_kv_shared_layers=0,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.0, 0.0],
    )
    spec = build_spec(resolve_source(str(ckpt)))
    assert {(b.attention.kind, b.attention.num_kv_heads) for b in spec.blocks} == {("gqa", KV_HEADS)}
    assert {(b.mlp.kind, b.mlp.intermediate_size) for b in spec.blocks} == {("dense_gated", 128)}
    assert spec.cost.kv_cache_bytes_per_token == _kv_bytes(2)


def test_blocks_that_share_kv_are_timed_each_on_its_own_inputs(tmp_path):
    """The throughput stage times every block on its captured inputs. Kolibri's layers hand each other K/V through a
    mapping the storing layer writes into: timing the storing layer must not leave the sharing layer a tensor from a
    freed graph (it failed with "backward through the graph a second time"), and capturing must not take the mapping
    away from the model (the sharing layer then missed its source)."""
    from collections import UserDict
    from types import SimpleNamespace

    from adapt.model.captured import fresh_input
    from validators.bench_calibration import block_calibration

    shared = UserDict({"1": (torch.ones(2, requires_grad=True) * 2,)})
    copied = fresh_input({"shared_kv_states": shared})["shared_kv_states"]
    assert type(copied) is UserDict and copied is not shared and not copied["1"][0].requires_grad
    model = AutoModelForCausalLM.from_pretrained(_kolibri(tmp_path), dtype=torch.float32)
    options = SimpleNamespace(seed=0, batch=1, seq_len=24, dtype="fp32")
    spec = build_spec(resolve_source(str(tmp_path / "kolibri1_1")))
    timings = block_calibration(model, options, "cpu", spec)["blocks"]
    assert [b["index"] for b in timings] == list(range(5))
    assert all(b["forward_s"] > 0 and b["backward_s"] > 0 for b in timings)
