"""Weight layouts that a reading by shape alone gets wrong, each from a transformers model type:

- DBRX keeps each expert bank as one 2-D matrix, experts stacked in its rows: an MoE, not a dense MLP.
- Zamba's Mamba mixers and XLNet's attention hold 3-D per-head matrices: no expert banks where nothing routes.
- Zamba's shared attention reads the width concatenated with the embeddings: a wide input, not MLA's low-rank latent;
  and that attention and its MLP sit together in one child, a transformer layer nested in the hybrid layer.
- Zaya splits its values into two half-width projections (the KV heads are the keys'), and its router adds a
  real buffer to weight-derived scores while the skeleton's weights are on the meta device.
- LFM2-MoE scores its router with a sigmoid: a scoring, not the experts' activation; its rotary settings, like
  Cohere Compass's, are given per layer kind.
- MusicGen's decoder reads several token streams (one embedding per codebook) and Reformer's reversible layers refuse
  a backward outside training mode: each is refused in one line, with the reason, not a traceback.

Each test is skipped on a transformers without the model type.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

from adapt.core.errors import BadInput, ModelCannotRun
from adapt.model.intake import build_spec, resolve_source


def _saved(tmp_path, model_type: str, **settings):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{"vocab_size": 256, **settings}))
    model.save_pretrained(tmp_path / model_type)
    return resolve_source(str(tmp_path / model_type))


def _spec(tmp_path, model_type: str, **settings):
    return build_spec(_saved(tmp_path, model_type, **settings))


def test_experts_stacked_in_the_rows_of_2d_matrices_are_an_moe(tmp_path):
    spec = _spec(
        tmp_path, "dbrx", d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"hidden_size": 64, "ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2},
    )  # fmt: skip
    for block in spec.blocks:
        assert (block.mlp.kind, block.mlp.num_experts, block.mlp.top_k) == ("moe", 4, 2)
        assert block.mlp.intermediate_size == 48 and block.mlp.expert_layout == "rows"
    experts = 2 * 3 * 4 * 48 * 64  # two blocks of w1, v1, w2
    assert spec.params.experts == experts
    idle = spec.params.total - spec.params.active_per_token
    assert idle == pytest.approx(experts / 2)  # top-2 of 4: half of them idle
    # adapt's expert parallelism shards [experts, ...] tensors: its plans keep these experts whole, and say so
    from parallel_planner.cluster import make_cluster
    from parallel_planner.search import plan_parallel
    from parallel_planner.workload import Workload

    plans = plan_parallel(spec, make_cluster("h100", 8), Workload(256, 64), top_k=5).plans
    assert plans and {p.plan.ep for p in plans} == {1}
    with pytest.raises(BadInput, match="ep>1: adapt's runtime shards experts kept as"):
        plan_parallel(spec, make_cluster("h100", 8), Workload(256, 64), fixed={"ep": 4})


def test_per_head_matrices_of_a_recurrent_mixer_are_no_experts(tmp_path):
    spec = _spec(
        tmp_path, "zamba", hidden_size=64, attention_hidden_size=128, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, attention_head_dim=32, num_key_value_heads=4, n_mamba_heads=2, attn_layer_period=1,
        attn_layer_offset=0, mamba_dt_rank=8, max_position_embeddings=256, use_mamba_kernels=False,
    )  # fmt: skip
    mamba, hybrid = spec.blocks[0], spec.blocks[2]
    assert mamba.mixer == "recurrent" and mamba.mlp.kind == "none" and mamba.attention is None
    assert hybrid.attention.kind == "mha" and hybrid.attention.head_dim == 32  # a 2x-wide input is no latent
    # the hybrid layer nests a whole transformer layer in one child: its feed-forward is the layer's MLP
    assert (hybrid.mlp.kind, hybrid.mlp.intermediate_size) == ("dense_gated", 128)
    assert spec.params.experts == 0 and spec.params.active_per_token == spec.params.total


def test_attention_kept_in_3d_per_head_matrices_is_attention_and_its_float64_twin_is_float64(tmp_path):
    from adapt.model.skeleton import load_model
    from validators.alignment import float64_forward

    src = _saved(tmp_path, "xlnet", d_model=64, n_layer=2, n_head=4, d_head=16, d_inner=128, mem_len=None)
    spec = build_spec(src)
    for block in spec.blocks:
        assert block.mixer == "full_attention"
        assert (block.attention.kind, block.attention.num_heads, block.attention.head_dim) == ("mha", 4, 16)
        assert block.mlp.kind == "dense_plain"
    assert spec.params.experts == 0
    notes: list[str] = []
    reference = load_model(src, torch.float64, notes=notes)  # XLNet makes its attention weights as FloatTensors
    assert {p.dtype for p in reference.parameters()} == {torch.float64} and "widened" in notes[-1]
    with float64_forward(reference), torch.no_grad():  # and builds its positions with .float()
        assert reference(input_ids=torch.randint(0, 256, (2, 8))).logits.dtype == torch.float64


def test_values_split_in_halves_keep_the_named_kv_heads_and_every_block_is_measured(tmp_path):
    from operators.api import run_ops

    src = _saved(
        tmp_path, "zaya", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=1,
        eos_token_id=106, bos_token_id=2, router_hidden_size=32, sliding_window=16,
        layer_types=["hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"],
    )  # fmt: skip
    spec = build_spec(src)
    assert [b.mixer for b in spec.blocks] == ["full_attention", "sliding_attention"] * 2
    for block in spec.blocks:
        assert (block.attention.kind, block.attention.num_heads, block.attention.num_kv_heads) == ("gqa", 4, 2)
        assert (block.mlp.kind, block.mlp.num_experts, block.mlp.top_k) == ("moe", 4, 1)
    attention = [c for c in run_ops(src, onnx=False, check_patch=False).plan.components if c.kind == "attention"]
    assert len(attention) == 4 and {(c.variant.num_heads, c.variant.num_kv_heads) for c in attention} == {(4, 2)}


def test_a_sigmoid_router_is_no_activation_and_rotary_per_layer_kind_is_read(tmp_path):
    spec = _spec(
        tmp_path, "lfm2_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, layer_types=["conv", "full_attention", "conv", "full_attention"],
    )  # fmt: skip
    routed = [b.mlp for b in spec.blocks if b.mlp.kind == "moe"]
    assert len(routed) == 3 and all(m.activation == "silu" and m.router_scoring == "sigmoid" for m in routed)
    compass = _spec(
        tmp_path, "cohere_compass_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=5, eos_token_id=255,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 12345.0, "mrope_section": [4, 2, 2]}},
    )  # fmt: skip
    assert compass.rope["theta"] == 12345.0 and compass.rope["scaling"] == {"mrope_section": [4, 2, 2]}


def test_several_token_streams_are_refused_in_one_line(tmp_path):
    if "musicgen" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no musicgen")
    from transformers import MusicgenDecoderConfig, MusicgenForCausalLM

    config = MusicgenDecoderConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, num_codebooks=4
    )
    MusicgenForCausalLM(config).save_pretrained(tmp_path / "musicgen")
    with pytest.raises(BadInput, match="input embedding is a ModuleList"):
        build_spec(resolve_source(str(tmp_path / "musicgen")))


def test_a_backward_the_model_refuses_in_eval_mode_is_refused_with_its_reason(tmp_path):
    from operators.api import run_ops

    src = _saved(
        tmp_path, "reformer", is_decoder=True, attn_layers=["local", "lsh"], axial_pos_shape=[4, 8],
        axial_pos_embds_dim=[16, 48], hidden_size=64, max_position_embeddings=32, num_attention_heads=4,
        attention_head_size=16, feed_forward_size=128, local_attn_chunk_length=16, lsh_attn_chunk_length=16,
        num_buckets=4, num_hashes=1,
    )  # fmt: skip
    with pytest.raises(ModelCannotRun, match="cannot be traced in eval mode: its backward raised AssertionError"):
        run_ops(src, onnx=False, check_patch=False)


def test_a_router_without_top_k_keeps_its_experts_and_a_swish_is_silu(tmp_path):
    """PhiMoE's sparse mixer routes without ``topk`` (its 3-D banks stay experts); gpt-oss's experts compute
    ``x * sigmoid(1.702 x)``, a swish, which the measurement must not read as a sigmoid activation."""
    phimoe = _spec(
        tmp_path, "phimoe", hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
    )  # fmt: skip
    assert all((b.mlp.kind, b.mlp.num_experts) == ("moe", 4) for b in phimoe.blocks)
    oss = _spec(
        tmp_path, "gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
    )  # fmt: skip
    assert all((b.mlp.kind, b.mlp.activation) == ("moe", "silu") for b in oss.blocks)


_SMALL = dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, max_position_embeddings=256)
BLT = dict(
    max_position_embeddings=256, local_attention_window_len=16, encoder_hash_byte_group_vocab=512,
    encoder_hash_byte_group_size=[3, 4],
    patcher_config=dict(_SMALL, hidden_size=64, num_hidden_layers=2, head_dim=16, sliding_window=16),
    encoder_config=dict(_SMALL, hidden_size=64, hidden_size_global=128, num_hidden_layers=1, sliding_window=16),
    decoder_config=dict(_SMALL, hidden_size=64, hidden_size_global=128, num_hidden_layers=2, head_dim=16),
    global_config=dict(_SMALL, hidden_size=128, num_hidden_layers=2, head_dim=32, intermediate_size=256),
)  # fmt: skip


def test_stacks_beside_the_described_one_are_named_with_their_share(tmp_path):
    """BLT runs bytes through a local encoder, patches through a global transformer and bytes again through a local
    decoder: the spec describes the encoder's stack (nearest the embedding) and says which stacks it leaves out."""
    spec = _spec(tmp_path, "blt", **BLT)
    assert [b.module for b in spec.blocks] == ["model.local_encoder.layers.0"]
    (note,) = [n for n in spec.novelties if "other repeated stack" in n]
    named = note.split(": ", 1)[1]
    assert named.startswith("model.global_transformer.layers (2 blocks, ")  # the largest first
    for path in ("model.local_decoder.layers (2 blocks", "model.patcher.layers (2 blocks"):
        assert path in named
    assert spec.params.other > spec.params.total / 2  # what the spec leaves out shows in its counts too
    # the local encoder's window sits in its own config, not the model's: its attention is sliding
    window = BLT["encoder_config"]["sliding_window"]
    assert (spec.blocks[0].mixer, spec.blocks[0].attention.window) == ("sliding_attention", window)


def test_token_ids_come_from_the_token_table_not_the_largest_embedding(tmp_path):
    """BLT's hashed n-gram tables are larger than its byte vocabulary: ids drawn up to their size crashed the
    runtime's tracing (and with it the throughput and soak stages)."""
    from adapt.model.calls import token_vocab
    from adapt.model.skeleton import load_model
    from adapt.runtime.model_parts import find_parts

    model = load_model(_saved(tmp_path, "blt", **BLT), dtype=torch.float32, device="cpu")
    tables = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    assert token_vocab(model) == model.config.vocab_size == 256 < max(tables)
    assert find_parts(model).blocks_path == "model.local_encoder.layers"


def test_token_ids_read_sequence_first_are_still_the_token_ids(tmp_path):
    """XLNet transposes its ids before the embedding: the runtime found no embedding reading them and refused to train
    it (the throughput and soak stages exited 2)."""
    from adapt.model.skeleton import load_model
    from adapt.runtime.model_parts import find_parts

    src = _saved(tmp_path, "xlnet", d_model=64, n_layer=2, n_head=4, d_head=16, d_inner=128, mem_len=None)
    parts = find_parts(load_model(src, dtype=torch.float32, device="cpu"))
    assert parts.embedding == "transformer.word_embedding" and parts.blocks_path == "transformer.layer"


def test_a_state_space_mixer_beside_attention_is_named_and_new(tmp_path):
    """Falcon-H1 runs Mamba-2 heads beside its attention in every layer: reading the attention alone called it a plain
    GQA transformer with nothing new."""
    spec = _spec(
        tmp_path, "falcon_h1", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_chunk_size=16, max_position_embeddings=256,
    )  # fmt: skip
    for block in spec.blocks:
        assert block.mixer == "full_attention" and block.attention.kind == "gqa"
        assert block.second_mixer in ("recurrent", "convolution")
    kind = spec.blocks[0].second_mixer
    assert f"{kind} token mixer besides attention in 2/2 blocks" in spec.novelties
    assert f"{kind} mixer besides attention in 2/2 blocks" in spec.features
    assert spec.summary().data["blocks"][0]["mixer"] == f"full_attention + {kind}"


def test_attention_alone_has_no_second_mixer(tmp_path):
    spec = _spec(tmp_path, "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    assert all(b.second_mixer is None for b in spec.blocks) and spec.novelties == []
