"""``benchmarks/sweep_tiny.py``, the sweep's tiny-config builder: generic repairs, never per model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _load(script: str) -> ModuleType:
    """A benchmark script by its path: ``benchmarks`` is not an installed package."""
    spec = importlib.util.spec_from_file_location(
        f"bench_{script}", Path(__file__).parents[2] / "benchmarks" / f"{script}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sweep_tiny, sweep = _load("sweep_tiny"), _load("sweep")


def test_token_ids_outside_the_vocabulary_land_on_its_last_id(rng):
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
    clamped = sweep_tiny.clamped_token_ids(settings, vocab)
    assert clamped == {"pad_token_id": vocab - 1, "eos_token_id": [inside, vocab - 1, vocab - 1]}
    assert sweep_tiny.clamped_token_ids(settings, None) == {}


def test_other_vocabulary_sizes_scale_with_the_vocabulary_and_keep_their_order(rng):
    default = rng.randrange(50_000, 300_000)
    below, above = default - rng.randrange(1, 5_000), default + rng.randrange(1, 5_000)
    settings = {"vocab_size": default, "unpadded_vocab_size": below, "input_vocab_size": above, "hidden_size": default}
    tiny = rng.randrange(64, 512)
    scaled = sweep_tiny.tied_vocab_sizes(settings, tiny, frozenset())
    assert set(scaled) == {"unpadded_vocab_size", "input_vocab_size"}  # not the vocabulary itself, not a width
    assert 1 <= scaled["unpadded_vocab_size"] <= tiny <= scaled["input_vocab_size"]
    assert sweep_tiny.tied_vocab_sizes(settings, tiny, frozenset({"input_vocab_size"})).keys() == {
        "unpadded_vocab_size"
    }
    assert sweep_tiny.tied_vocab_sizes(settings, None, frozenset()) == {}


def test_head_counts_under_other_names_shrink_with_the_width(rng):
    heads = rng.randrange(5, 64)
    settings = {"encoder_attention_heads": heads, "decoder_attention_heads": heads + 1, "num_attention_heads": heads}
    settings["attention_heads_ratio"] = 0.5  # not a count
    tiny = sweep_tiny.TINY["num_attention_heads"]
    assert sweep_tiny.tied_head_counts(settings, frozenset()) == {
        "encoder_attention_heads": tiny,
        "decoder_attention_heads": tiny,
    }
    assert sweep_tiny.tied_head_counts(settings, frozenset({"encoder_attention_heads"})) == {
        "decoder_attention_heads": tiny
    }
    grouped = {"swa_num_attention_heads": heads, "swa_num_key_value_heads": rng.randrange(1, heads)}
    assert sweep_tiny.tied_head_counts(grouped, frozenset()) == {
        "swa_num_attention_heads": tiny,
        "swa_num_key_value_heads": sweep_tiny.TINY["num_key_value_heads"],  # never more KV heads than query heads
    }
    full = {"swa_num_attention_heads": heads, "swa_num_key_value_heads": heads}
    assert sweep_tiny.tied_head_counts(full, frozenset())["swa_num_key_value_heads"] == tiny


@pytest.mark.parametrize("model_type", ["kimi_linear", "olmo_hybrid"])
def test_tiny_config_keeps_every_token_id_in_the_vocabulary(model_type):
    config = sweep_tiny.tiny_config(model_type)
    assert config.vocab_size == sweep_tiny.TINY["vocab_size"]
    for name, value in config.to_dict().items():
        if name.endswith("_token_id") and value is not None:
            ids = value if isinstance(value, list) else [value]
            assert all(0 <= v < config.vocab_size for v in ids), (name, value)


def test_unset_optional_sizes_are_filled_by_name_and_other_fields_left_alone():
    plain = sweep_tiny.tiny_config("qwen4_exp_text")
    assert plain.indexer_budget is None  # only a retry fills them
    filled = sweep_tiny.tiny_config("qwen4_exp_text", fill_unset=True)
    assert filled.indexer_head_dim == sweep_tiny.FILL_BY_SUFFIX["_head_dim"]
    assert filled.indexer_n_heads == filled.indexer_kv_heads == sweep_tiny.FILL_BY_SUFFIX["_heads"]
    assert filled.indexer_budget % filled.indexer_compress_ratio == 0
    assert filled.output_gate_type is None  # a str field is not a size
    assert filled.hidden_size == sweep_tiny.TINY["hidden_size"]


@pytest.mark.parametrize("model_type", ["qwen4_exp_text", "olmo_hybrid"])
def test_build_saves_a_tiny_checkpoint(model_type, tmp_path, capsys):
    sweep_tiny.build(model_type, tmp_path)
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < built["params"] < 60_000_000
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == model_type


def test_per_layer_settings_follow_the_layers_kept_at_the_tiny_depth(rng):
    """Every layer kind keeps a layer, and each kept layer brings its own entry of every per-layer setting."""
    before, depth, period = rng.randint(12, 60), rng.randint(2, 6), rng.randint(2, 8)
    types = ["full_attention" if i % period == period - 1 else "sliding_attention" for i in range(before)]
    shared = rng.randint(depth, before - 1)
    settings = {
        "num_hidden_layers": before,
        "intermediate_size": [rng.randint(64, 512) for _ in range(before)],
        "layer_types": types,
        "per_layer_config": {f"{i:02d}": {"head_dim": 512} for i in range(before) if types[i] == "full_attention"},
        "num_kv_shared_layers": shared,
        "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
        "rope_parameters": {"rope_theta": 1e4},
        "eos_token_id": [1, 2],
    }
    kept = sweep_tiny.kept_layers(settings, depth)
    assert len(kept) == depth and kept == sorted(set(kept)) and {types[i] for i in kept} == set(types)
    trimmed = sweep_tiny.per_layer_trimmed(settings, depth)
    assert set(trimmed) == {"intermediate_size", "layer_types", "per_layer_config", "num_kv_shared_layers"}
    assert trimmed["layer_types"] == [types[i] for i in kept]
    assert trimmed["intermediate_size"] == [settings["intermediate_size"][i] for i in kept]
    full = {f"{n:02d}" for n, kind in enumerate(trimmed["layer_types"]) if kind == "full_attention"}
    assert set(trimmed["per_layer_config"]) == full and all(
        v == {"head_dim": 512} for v in trimmed["per_layer_config"].values()
    )
    assert 1 <= trimmed["num_kv_shared_layers"] <= depth
    assert sweep_tiny.per_layer_trimmed({**settings, "num_hidden_layers": depth}, depth) == {}


def test_sizes_tied_to_a_residual_width_shrink_with_it(rng):
    text, vision = rng.choice([2048, 4096, 5120]), rng.choice([1024, 1152, 1536])
    settings = {
        "hidden_size": text,
        "vision_config": {"hidden_size": vision, "adapter_in_dim": vision, "adapter_out_dim": text, "patch_size": 14},
        "projector_hidden_act": "gelu",
        "image_size": 896,
    }
    widths = sweep_tiny.hidden_widths(settings)
    assert widths == {text, vision}
    assert sweep_tiny.tied_widths(settings["vision_config"], widths, frozenset()) == {
        "adapter_in_dim": sweep_tiny.TINY["hidden_size"],
        "adapter_out_dim": sweep_tiny.TINY["hidden_size"],
    }
    assert sweep_tiny.tied_widths(settings["vision_config"], widths, frozenset({"adapter_out_dim"})) == {
        "adapter_in_dim": sweep_tiny.TINY["hidden_size"]
    }


def test_nested_configs_shrink_to_the_tiny_depth_with_their_per_layer_lists():
    """Gemma 3n's text tower inside its multimodal config: a sparsity value per layer, layer types."""
    text = sweep_tiny.tiny_config("gemma3n").text_config
    depth = sweep_tiny.TINY["num_hidden_layers"]
    assert text.num_hidden_layers == depth and text.hidden_size == sweep_tiny.TINY["hidden_size"]
    assert len(text.activation_sparsity_pattern) == len(text.layer_types) == depth
    assert set(text.layer_types) == {"sliding_attention", "full_attention"}


@pytest.mark.parametrize("model_type", ["bart", "marian"])
def test_every_layer_count_shrinks_where_the_config_aliases_its_depth(model_type):
    """BART's ``num_hidden_layers`` reads ``encoder_layers``: its decoder depth must shrink with it, or the tiny
    decoder holds more layers than the cache transformers sizes from ``num_hidden_layers`` (an IndexError in decode)."""
    config = sweep_tiny.tiny_config(model_type)
    depth = sweep_tiny.TINY["num_hidden_layers"]
    assert config.num_hidden_layers == config.encoder_layers == config.decoder_layers == depth


@pytest.mark.parametrize("model_type", ["gemma4_unified", "dots3_note"])
def test_multimodal_and_per_layer_configs_build_tiny(model_type, tmp_path, capsys):
    """A text tower nested in a multimodal config, per-layer overrides that must agree across layers of a kind,
    attention that needs as many KV heads as query heads, an adapter width tied to the hidden size."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    sweep_tiny.build(model_type, tmp_path)
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < built["params"] < 2_000_000
    saved = json.loads((tmp_path / "config.json").read_text())
    text = saved.get("text_config", saved)
    assert text["num_hidden_layers"] == sweep_tiny.TINY["num_hidden_layers"]
    assert len(set(text["layer_types"])) > 1


def test_a_per_layer_model_builds_tiny(tmp_path, capsys):
    """Gemma 3n: per-layer intermediate sizes and sparsity, shared-KV layers and per-layer-input embeddings."""
    sweep_tiny.build("gemma3n_text", tmp_path)
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < built["params"] < 2_000_000


def test_a_failed_build_is_summed_up_by_the_exception_it_ended_with(rng):
    """Not the traceback's last line: an exception whose message spans lines (validation errors, missing packages)."""
    reason = f"must equal num_hidden_layers ({rng.randint(2, 99)})"
    trace = (
        'Traceback (most recent call last):\n  File "config.py", line 3, in __init__\n    validate(self)\n    ^^^^\n'
        "StrictDataclassClassValidationError: Class validation error for validator:\n"
        f"    ValueError: {reason}\n"
    )
    assert (
        sweep._first_error_line(trace)
        == f"StrictDataclassClassValidationError: Class validation error for validator: ValueError: {reason}"
    )
    assert sweep._first_error_line("a warning\nadapt: error: no config.json\n") == "adapt: error: no config.json"


def test_head_widths_equal_by_default_stay_equal():
    """MLA rotates qk_rope_head_dim channels with tables of head_dim: a tiny config that splits them cannot run."""
    config = sweep_tiny.tiny_config("axk1")
    default = sweep_tiny.tiny_config("axk1", keep=frozenset(sweep_tiny.TINY))  # nothing shrunk
    assert default.head_dim == default.qk_rope_head_dim
    assert config.head_dim == config.qk_rope_head_dim < default.head_dim


def test_an_all_zero_matrix_from_initialisation_is_redrawn():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight.zero_()
        model[0].bias.zero_()
    kept = model[0].weight.clone()
    sweep_tiny.redraw_untrained_zeros(model)
    assert model[1].weight.any() and model[1].weight.abs().max() < 0.2
    assert torch.equal(model[0].weight, kept) and not model[0].bias.any()  # biases and drawn weights stay


def test_a_multimodal_checkpoint_with_a_tied_head_is_complete(tmp_path, capsys):
    """transformers 5 saves the tied head of a multimodal wrapper under its on-disk name: no tensor is missing; a
    checkpoint that lost the embedding the head is tied to is."""
    from safetensors.torch import load_file, save_file

    from adapt.app.cli import main

    sweep_tiny.build("gemma3", tmp_path)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"]["missing"] == []
    weights = load_file(tmp_path / "model.safetensors")
    embedding = next(name for name in weights if name.startswith("language_model") and "embed_tokens" in name)
    save_file({k: v for k, v in weights.items() if k != embedding}, tmp_path / "model.safetensors")
    main(["inspect", str(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out)["checkpoint"]["missing"]
