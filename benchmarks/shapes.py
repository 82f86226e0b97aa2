"""The reference model shapes the GPU benchmarks build, in one place: the public configs' widths with random weights,
and the rehearsal widths a CPU runs them at.  Every checkpoint is saved with ``save_pretrained``, so each benchmark
loads it through transformers' own loader, as a user's checkpoint would be.

* ``llama-1b``: Llama-3.2-1B (hidden 2048, ffn 8192, 16 layers, 32/8 heads, vocab 128256, tied, llama3 rope scaling).
* ``gemma2-2b``: Gemma-2-2B (hidden 2304, ffn 9216, 26 layers, 8/4 heads of 256, vocab 256000, tied, soft-capping).
* ``qwen3-moe``: Qwen3-30B-A3B's width at 3 layers (128 experts of 768, top-8, 32/4 heads of 128, vocab 151936).
* ``qwen2-0.5b``: Qwen2-0.5B (hidden 896, ffn 4864, 24 layers, 14/2 heads, vocab 151936, tied).
* ``gpt-oss``: gpt-oss-20b's width at 4 layers (sliding 128 and full attention alternating, 64/8 heads of 64 with
  learned sinks, 32 experts of 2880, top-4, vocab 201088).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": {
        "model_type": "llama",
        "full": {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        "tiny": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "tie_word_embeddings": True,
            "max_position_embeddings": 256,
        },
    },
    "gemma2-2b": {
        "model_type": "gemma2",
        "full": {
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "vocab_size": 256000,
            "tie_word_embeddings": True,
            "max_position_embeddings": 8192,
            "sliding_window": 4096,
            "query_pre_attn_scalar": 256,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
        "tiny": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 256,
            "tie_word_embeddings": True,
            "max_position_embeddings": 256,
            "sliding_window": 16,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    },
    "qwen3-moe": {
        "model_type": "qwen3_moe",
        "full": {
            "hidden_size": 2048,
            "moe_intermediate_size": 768,
            "intermediate_size": 6144,
            "num_hidden_layers": 3,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": 151936,
            "tie_word_embeddings": False,
            "max_position_embeddings": 8192,
        },
        "tiny": {
            "hidden_size": 64,
            "moe_intermediate_size": 32,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": 256,
            "tie_word_embeddings": False,
            "max_position_embeddings": 256,
        },
    },
    "qwen2-0.5b": {
        "model_type": "qwen2",
        "full": {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-06,
        },
        "tiny": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "max_position_embeddings": 256,
            "tie_word_embeddings": True,
        },
    },
    "gpt-oss": {
        "model_type": "gpt_oss",
        "full": {
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 4,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "vocab_size": 201088,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
        },
        "tiny": {
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "vocab_size": 256,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": 256,
        },
    },
}


def build_checkpoint(name: str, path: Path, tiny: bool = False, device: str = "cpu") -> Path:
    """Random-init bf16 weights for shape ``name`` (rehearsal widths with ``tiny``), saved to ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = SHAPES[name]
    config = AutoConfig.for_model(shape["model_type"], **shape["tiny" if tiny else "full"])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return Path(path)


def load_checkpoint(path: Path, attn_implementation: str | None = None):
    """The bf16 model at ``path`` as adapt loads it (on the CPU): a configured attention soft-cap stays applied
    (``skeleton.keep_attention_faithful``), unless ``attn_implementation`` names the attention to use."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from adapt.model.skeleton import keep_attention_faithful

    config = AutoConfig.from_pretrained(path)
    if attn_implementation:
        config._attn_implementation = attn_implementation
    else:
        keep_attention_faithful(config)
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.bfloat16)
