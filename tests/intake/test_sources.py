"""Source resolution: hub ids through a populated HF cache (offline), directories, bare configs."""

from __future__ import annotations

import json
import shutil

import pytest

from adapt.app.cli import main
from adapt.model.intake import inspect, resolve_source


@pytest.fixture
def hub_cache(zoo, tmp_path, monkeypatch):
    """A huggingface_hub cache laid out as the hub client writes it, holding acme/tiny-llama at two revisions."""
    import huggingface_hub.constants as constants

    repo = tmp_path / "models--acme--tiny-llama"
    for commit, ref in (("a" * 40, "main"), ("b" * 40, "v2")):
        snap = repo / "snapshots" / commit
        shutil.copytree(zoo("llama"), snap)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    cfg = json.loads((repo / "snapshots" / ("b" * 40) / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (repo / "snapshots" / ("b" * 40) / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def test_hub_id_resolves_offline_through_the_cache(hub_cache):
    src = resolve_source("acme/tiny-llama")
    assert src.kind == "hub" and src.hub_id == "acme/tiny-llama"
    assert src.root.endswith("a" * 40) and src.weight_format == "safetensors"
    spec = inspect("acme/tiny-llama")
    assert spec.model_type == "llama" and spec.blocks[0].norm.eps == 1e-6


def test_hub_revision_is_honoured(hub_cache):
    src = resolve_source("acme/tiny-llama@v2")
    assert src.revision == "v2" and src.root.endswith("b" * 40)
    assert inspect("acme/tiny-llama@v2").blocks[0].norm.eps == 1e-5


def test_config_only_never_touches_weights(zoo, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(zoo("qwen3_moe"), ckpt)
    (ckpt / "model.safetensors").write_bytes(b"garbage that is not a safetensors file")
    spec = inspect(str(ckpt), config_only=True)
    assert spec.checkpoint is None and spec.blocks[0].mlp.kind == "moe"
    with pytest.raises(Exception, match="model.safetensors"):
        inspect(str(ckpt))


def test_sharded_checkpoint_with_index(zoo, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(zoo("mixtral"))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    src = resolve_source(str(tmp_path / "sharded"))
    assert len(src.weight_files) > 1 and src.index_file
    spec = inspect(str(tmp_path / "sharded"))
    assert len(spec.checkpoint.files) == len(src.weight_files) and not spec.checkpoint.missing


def test_json_contract(zoo, capsys):
    assert main(["inspect", str(zoo("qwen3_moe")), "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    data = json.loads(out)
    for key in ("model_type", "params_total", "params_active", "num_layers", "blocks", "flops_per_token",
                "kv_cache_bytes_per_token", "unrecognized"):  # fmt: skip
        assert key in data
    assert set(data["flops_per_token"]) >= {"forward", "train", "seq_len"}
    assert data["params_active"] < data["params_total"] and isinstance(data["blocks"], list)


def test_tied_embeddings_are_accounted(zoo):
    spec = inspect(str(zoo("qwen3")))
    assert spec.checkpoint.tied == [["lm_head.weight", "model.embed_tokens.weight"]]
    assert spec.checkpoint.missing == []


def test_a_config_transformers_saved_with_an_infinite_float_is_read_back_as_transformers_reads_it(tmp_path):
    """transformers writes inf/-inf/nan as {"__float__": "Infinity"}; the source holds the float and the config
    passes transformers' own checks, as a config reloaded by transformers does."""
    import math
    import random

    from transformers import AutoConfig, LlamaConfig

    bound = random.uniform(0.0, 1.0)
    LlamaConfig(
        hidden_size=64, num_attention_heads=4, time_step_limit=(bound, math.inf), clip=-math.inf
    ).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["time_step_limit"][1] == {"__float__": "Infinity"}
    config = resolve_source(str(tmp_path / "config.json")).config_dict
    assert config["time_step_limit"] == [bound, math.inf] and config["clip"] == -math.inf
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert list(reloaded.time_step_limit) == config["time_step_limit"] and reloaded.clip == config["clip"]
    assert inspect(str(tmp_path), config_only=True).model_type == "llama"
