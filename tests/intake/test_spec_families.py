"""ModelSpec fields per zoo family, derived from real transformers modelling code."""

from __future__ import annotations

import json
import math

import pytest
from safetensors import safe_open

from adapt.core.spec import ModelSpec
from adapt.model.intake import inspect


def spec_of(zoo, name: str) -> ModelSpec:
    return inspect(str(zoo(name)), trust_remote_code=(name == "custom"))


def test_params_total_equals_checkpoint_parameter_elements(zoo_model):
    name, path = zoo_model
    spec = inspect(str(path), trust_remote_code=(name == "custom"))
    ck = spec.checkpoint
    assert ck is not None and not ck.missing and not ck.shape_mismatches
    # Buffers saved beside parameters (position ids, routing correction biases) are not parameters.
    from adapt.model.intake import build_meta_model, resolve_source

    model = build_meta_model(resolve_source(str(path), trust_remote_code=(name == "custom")))
    buffer_names = {n for n, _ in model.named_buffers()}
    elements = 0
    with safe_open(next(path.glob("*.safetensors")), "pt") as fh:
        for key in fh.keys():
            if key in buffer_names:
                continue
            elements += math.prod(fh.get_slice(key).get_shape())
    assert spec.params_total == elements
    parts = spec.params
    assert parts.total == sum(
        getattr(parts, k)
        for k in (
            "embeddings",
            "attention",
            "dense_mlp",
            "experts",
            "shared_experts",
            "router",
            "norms",
            "lm_head",
            "other",
        )
    )
    assert spec.params_active <= spec.params_total


def test_spec_round_trips_through_json(zoo):
    spec = spec_of(zoo, "deepseek_v3")
    again = ModelSpec.from_dict(json.loads(spec.to_json()))
    assert again.to_dict() == spec.to_dict()


@pytest.mark.parametrize(
    "name, attn_kind, heads, kv_heads, mlp_kind, norm_kind, placement",
    [
        ("llama", "gqa", 4, 2, "dense_gated", "rmsnorm", "pre"),
        ("mistral", "mqa", 4, 1, "dense_gated", "rmsnorm", "pre"),
        ("mixtral", "gqa", 4, 2, "moe", "rmsnorm", "pre"),
        ("qwen2", "gqa", 4, 2, "dense_gated", "rmsnorm", "pre"),
        ("qwen3", "gqa", 4, 2, "dense_gated", "rmsnorm", "pre"),
        ("qwen3_moe", "gqa", 4, 2, "moe", "rmsnorm", "pre"),
        ("gemma2", "gqa", 4, 2, "dense_gated", "rmsnorm", "sandwich"),
        ("deepseek_v3", "mla", 4, 4, "moe", "rmsnorm", "pre"),
        ("gpt2", "mha", 4, 4, "dense_plain", "layernorm", "pre"),
        ("bert", "mha", 12, 12, "dense_plain", "layernorm", "post"),
        ("custom", "gqa", 4, 2, "dense_gated", "rmsnorm", "pre"),
    ],
)
def test_block_structure(zoo, name, attn_kind, heads, kv_heads, mlp_kind, norm_kind, placement):
    spec = spec_of(zoo, name)
    last = spec.blocks[-1]
    assert last.attention is not None
    assert (last.attention.kind, last.attention.num_heads, last.attention.num_kv_heads) == (attn_kind, heads, kv_heads)
    assert last.mlp.kind == mlp_kind
    assert (last.norm.kind, last.norm.placement) == (norm_kind, placement)


def test_family_details(zoo):
    gemma = spec_of(zoo, "gemma2")
    assert gemma.blocks[0].norm.offset == 1.0 and gemma.blocks[0].mlp.activation == "gelu_tanh"
    assert [b.attention.window for b in gemma.blocks] == [16, None]
    assert gemma.blocks[0].mixer == "sliding_attention" and gemma.blocks[1].mixer == "full_attention"
    assert gemma.blocks[0].attention.softcap == 50.0 and gemma.tie_word_embeddings

    mistral = spec_of(zoo, "mistral")
    assert all(b.attention.window == 16 for b in mistral.blocks)

    qwen3 = spec_of(zoo, "qwen3")
    assert qwen3.blocks[0].attention.qk_norm and qwen3.tie_word_embeddings and qwen3.params.lm_head == 0

    ds = spec_of(zoo, "deepseek_v3")
    assert [b.mlp.kind for b in ds.blocks] == ["dense_gated", "moe", "moe"]
    moe = ds.blocks[1].mlp
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.n_group, moe.topk_group) == (8, 2, 1, 4, 2)
    a = ds.blocks[1].attention
    assert (a.kv_lora_rank, a.q_lora_rank, a.qk_rope_head_dim, a.head_dim, a.v_head_dim) == (16, 32, 8, 24, 16)
    # MLA caches the latent plus the shared rope key: (16 + 8) float32 values per layer.
    assert ds.cost.kv_cache_bytes_per_token == 3 * (16 + 8) * 4

    mixtral = spec_of(zoo, "mixtral")
    m = mixtral.blocks[0].mlp
    assert (m.num_experts, m.top_k, m.intermediate_size) == (4, 2, 96)
    expert_params = 2 * 4 * 3 * 64 * 96
    assert mixtral.params.experts == expert_params
    assert mixtral.params_total - mixtral.params_active == expert_params // 2

    gpt2 = spec_of(zoo, "gpt2")
    assert gpt2.blocks[0].mlp.activation == "gelu_tanh" and gpt2.blocks[0].positional == "none"

    bert = spec_of(zoo, "bert")
    assert not bert.is_causal and bert.cost.kv_cache_bytes_per_token == 0
    assert bert.blocks[0].mlp.activation == "gelu" and bert.blocks[0].norm.eps == 1e-12

    llama = spec_of(zoo, "llama")
    assert llama.blocks[0].positional == "rope" and llama.rope["rotary_dim"] == 16
    assert llama.unrecognized == [] and llama.novelties == []  # standard GQA is a known kind, not new
    assert "GQA attention in 2/2 blocks" in llama.features


def test_custom_model_novel_op_is_unrecognised_and_renamed_parts_are_not(zoo):
    spec = spec_of(zoo, "custom")
    assert spec.unrecognized and all(u.startswith("Quench") for u in spec.unrecognized)
    assert any("Quench" in n for n in spec.novelties)
    assert spec.blocks[0].norm.kind == "rmsnorm" and spec.blocks[0].norm.eps == 1e-5


def test_flops_follow_linear_shapes(zoo):
    spec = spec_of(zoo, "llama")
    h, inner, vocab, seq = 64, 128, 256, spec.cost.seq_len
    per_block = 2 * (h * h + 2 * h * 32 + h * h) + 2 * 3 * h * inner
    assert spec.blocks[0].linear_flops_per_token == per_block
    attention = 2 * 4 * (16 + 16) * seq / 2
    assert spec.cost.forward_flops_per_token == 2 * per_block + 2 * int(attention) + 2 * h * vocab
    assert spec.cost.train_flops_per_token == 3 * spec.cost.forward_flops_per_token
    assert spec.cost.kv_cache_bytes_per_token == 2 * 2 * (16 + 16) * 4
