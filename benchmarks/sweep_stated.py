"""Tiny settings written by hand, for the model types whose transformers default config cannot be shrunk.

``sweep_tiny.build`` repairs generically (a knob the model rejects keeps its default, an unset size is filled by its
name), which reaches every type whose defaults build.  A few do not build at any size, each for a reason of its
own config class: a nested sub-config without a field its model reads (DBRX's attention config and ``rope_theta``),
a layer schedule or size left unset (Dots1's sliding window, LFM2-MoE's layer types, Zaya's router), validation that
ties sizes the defaults already break (Mamba2's heads and expansion), rotary settings keyed by a layer kind the
defaults do not name (Cohere Compass), a flag the causal-LM class insists on (Reformer's ``is_decoder``), no length
limit at all (XLNet's ``mem_len``), or tied-weight keys that need the hybrid schedule stated (Zamba); one builds but stays large when shrunk, its
sub-configs and hash-embedding tables out of the generic knobs' reach (BLT: 193M parameters).  For those the
sweep builds from a config stated here, as a user would write one; it tries the generic builder first, so a type
whose defaults are repaired upstream leaves this table unread, and the row says which one built it.  adapt itself
never reads this table.
"""

from __future__ import annotations

from typing import Any

STATED_SETTINGS: dict[str, dict[str, Any]] = {
    "dbrx": dict(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=256,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(hidden_size=64, ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
    "dots1": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=256,
        sliding_window=None, max_window_layers=3,
    ),
    "lfm2_moe": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, layer_types=["conv", "full_attention", "conv", "full_attention"],
    ),
    "zamba": dict(
        vocab_size=256, hidden_size=64, attention_hidden_size=128, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, attention_head_dim=32, num_key_value_heads=4, n_mamba_heads=2, attn_layer_period=1,
        attn_layer_offset=0, mamba_dt_rank=8, max_position_embeddings=256, use_mamba_kernels=False,
    ),
    "mamba2": dict(
        num_heads=8, head_dim=16, hidden_size=64, expand=2, state_size=16, n_groups=2, num_hidden_layers=2,
        vocab_size=256, time_step_rank=8, chunk_size=16,
    ),
    "cohere_compass_text": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=5, eos_token_id=255, sliding_window=16,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}},
    ),
    "zaya": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=1,
        eos_token_id=106, bos_token_id=2, router_hidden_size=32, sliding_window=16,
        layer_types=["hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"],
    ),
    "xlnet": dict(vocab_size=256, d_model=64, n_layer=2, n_head=4, d_head=16, d_inner=128, mem_len=None),
    "reformer": dict(
        vocab_size=256, is_decoder=True, attn_layers=["local", "lsh"], axial_pos_shape=[4, 8],
        axial_pos_embds_dim=[16, 48], hidden_size=64, max_position_embeddings=32, num_attention_heads=4,
        attention_head_size=16, feed_forward_size=128, local_attn_chunk_length=16, lsh_attn_chunk_length=16,
        num_buckets=4, num_hashes=1,
    ),
    "blt": dict(
        vocab_size=260, max_position_embeddings=256, local_attention_window_len=16, encoder_hash_byte_group_vocab=512,
        encoder_hash_byte_group_size=[3, 4],
        patcher_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                            intermediate_size=128, head_dim=16, sliding_window=16, max_position_embeddings=256),
        encoder_config=dict(hidden_size=64, hidden_size_global=128, num_attention_heads=4, num_key_value_heads=4,
                            num_hidden_layers=1, intermediate_size=128, sliding_window=16, max_position_embeddings=256),
        decoder_config=dict(hidden_size=64, hidden_size_global=128, num_attention_heads=4, num_key_value_heads=4,
                            num_hidden_layers=2, intermediate_size=128, head_dim=16, max_position_embeddings=256),
        global_config=dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                           intermediate_size=256, head_dim=32, max_position_embeddings=256),
    ),
}  # fmt: skip
