"""``benchmarks/sweep.py``'s tiny-config builder: generic repairs, never per model."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("bench_sweep", Path(__file__).parents[2] / "benchmarks" / "sweep.py")
sweep = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = sweep
SPEC.loader.exec_module(sweep)


def test_token_ids_outside_the_vocabulary_land_on_its_last_id():
    rng = random.Random()
    vocab = rng.randrange(64, 512)
    inside = rng.randrange(vocab)
    settings = {
        "pad_token_id": vocab + rng.randrange(1, 10**6),
        "bos_token_id": inside,
        "eos_token_id": [inside, vocab, vocab + 7],
        "image_token_id": None,
        "vocab_size": vocab,
        "hidden_size": vocab * 4,
    }
    clamped = sweep.clamped_token_ids(settings, vocab)
    assert clamped == {"pad_token_id": vocab - 1, "eos_token_id": [inside, vocab - 1, vocab - 1]}
    assert sweep.clamped_token_ids(settings, None) == {}


@pytest.mark.parametrize("model_type", ["kimi_linear", "olmo_hybrid"])
def test_tiny_config_keeps_every_token_id_in_the_vocabulary(model_type):
    config = sweep.tiny_config(model_type)
    assert config.vocab_size == sweep.TINY["vocab_size"]
    for name, value in config.to_dict().items():
        if name.endswith("_token_id") and value is not None:
            ids = value if isinstance(value, list) else [value]
            assert all(0 <= v < config.vocab_size for v in ids), (name, value)


def test_unset_optional_sizes_are_filled_by_name_and_other_fields_left_alone():
    plain = sweep.tiny_config("qwen4_exp_text")
    assert plain.indexer_budget is None  # only a retry fills them
    filled = sweep.tiny_config("qwen4_exp_text", fill_unset=True)
    assert filled.indexer_head_dim == sweep.FILL_BY_SUFFIX["_head_dim"]
    assert filled.indexer_n_heads == filled.indexer_kv_heads == sweep.FILL_BY_SUFFIX["_heads"]
    assert filled.indexer_budget % filled.indexer_compress_ratio == 0
    assert filled.output_gate_type is None  # a str field is not a size
    assert filled.hidden_size == sweep.TINY["hidden_size"]


@pytest.mark.parametrize("model_type", ["qwen4_exp_text", "olmo_hybrid"])
def test_build_saves_a_tiny_checkpoint(model_type, tmp_path, capsys):
    sweep.build(model_type, tmp_path)
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < built["params"] < 60_000_000
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == model_type


def test_per_layer_settings_are_cut_to_the_tiny_depth():
    rng = random.Random()
    before, depth = rng.randint(12, 60), rng.randint(2, 6)
    shared = rng.randint(depth, before - 1)
    settings = {
        "num_hidden_layers": before,
        "intermediate_size": [rng.randint(64, 512) for _ in range(before)],
        "per_layer_config": {f"{i:02d}": {"head_dim": 512} for i in range(1, before, 3)},
        "layer_types": ["full_attention"] * before,  # a schedule is recomputed, not cut
        "num_kv_shared_layers": shared,
        "rope_parameters": {"rope_theta": 1e4},
        "eos_token_id": [1, 2],
    }
    trimmed = sweep.per_layer_trimmed(settings, depth)
    assert trimmed["intermediate_size"] == settings["intermediate_size"][:depth]
    assert all(int(k) < depth for k in trimmed["per_layer_config"])
    assert 1 <= trimmed["num_kv_shared_layers"] <= depth
    assert set(trimmed) == {"intermediate_size", "per_layer_config", "num_kv_shared_layers"}
    assert sweep.per_layer_trimmed({**settings, "num_hidden_layers": depth}, depth) == {}


def test_a_per_layer_model_builds_tiny(tmp_path, capsys):
    """Gemma 3n: per-layer intermediate sizes and sparsity, shared-KV layers and per-layer-input embeddings."""
    sweep.build("gemma3n_text", tmp_path)
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < built["params"] < 2_000_000
