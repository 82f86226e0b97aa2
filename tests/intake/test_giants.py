"""Config-only giants: structure and parameter counts of DeepSeek-V3 (671B) and Llama-3.1-405B."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adapt.model.intake import inspect


@pytest.fixture(scope="module")
def giants(tmp_path_factory):
    from transformers import DeepseekV3Config, LlamaConfig

    root = tmp_path_factory.mktemp("giants")
    DeepseekV3Config().save_pretrained(root / "deepseek_v3")
    LlamaConfig(
        hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=False, dtype="bfloat16",
    ).save_pretrained(root / "llama405b")  # fmt: skip
    return root


def test_deepseek_v3_counts(giants):
    spec = inspect(str(giants / "deepseek_v3" / "config.json"))
    assert abs(spec.params_total / 671.0e9 - 1) < 0.005
    assert abs(spec.params_active / 37e9 - 1) < 0.03
    assert spec.num_layers == 61
    assert [b.mlp.kind for b in spec.blocks[:4]] == ["dense_gated"] * 3 + ["moe"]
    moe = spec.blocks[3].mlp
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.intermediate_size) == (256, 8, 1, 2048)
    assert spec.blocks[0].attention.kind == "mla" and spec.blocks[0].attention.kv_lora_rank == 512
    assert spec.checkpoint is None


def test_llama_405b_counts(giants):
    spec = inspect(str(giants / "llama405b"), config_only=True)
    assert abs(spec.params_total / 405.9e9 - 1) < 0.005
    assert spec.params_active == spec.params_total
    a = spec.blocks[0].attention
    assert (a.kind, a.num_heads, a.num_kv_heads, a.head_dim) == ("gqa", 128, 8, 128)
    # bf16 KV cache: 126 layers * 8 kv heads * (128 + 128) * 2 bytes
    assert spec.cost.kv_cache_bytes_per_token == 126 * 8 * 256 * 2


def test_deepseek_v3_inspect_stays_small(giants):
    """The CLI builds the 671B skeleton on the meta device: peak RSS stays far under 2 GB."""
    code = (
        "import resource, sys, json; from adapt.app.cli import main; rc = main(['inspect', sys.argv[1], '--json']);"
        "print(json.dumps({'rss_kb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), file=sys.stderr)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(giants / "deepseek_v3" / "config.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["model_type"] == "deepseek_v3" and out["params_total"] > 6e11
    rss_kb = json.loads(proc.stderr.strip().splitlines()[-1])["rss_kb"]
    assert rss_kb < 2 * 1024 * 1024
