"""Rotary embedding against float64 references and against Hugging Face's own rotary module."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, assert_close, leaf, ref_leaf

from operators.kernels import apply_rotary


def reference_rotary(x, cos, sin, interleaved, rotary_dim):
    """float64 rotation of the first ``rotary_dim`` dims; cos/sin in HF's cat(f, f) layout."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    c, s = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return torch.cat([out, rest], dim=-1)


def _cos_sin(batch, seq, rotary_dim, dtype, positions=None):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=DEVICE, dtype=torch.float64) / rotary_dim))
    pos = positions if positions is not None else torch.arange(seq, device=DEVICE).expand(batch, seq)
    freqs = pos.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _check(q_in, k_in, cos, sin, interleaved, rotary_dim, dtype):
    q, k = leaf(q_in), leaf(k_in)
    q64, k64 = ref_leaf(q_in), ref_leaf(k_in)
    qo, ko = apply_rotary(q, k, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()  # outputs keep the inputs' layout
    r = rotary_dim or cos.shape[-1]
    ref_q = reference_rotary(q64, cos.double(), sin.double(), interleaved, r)
    ref_k = reference_rotary(k64, cos.double(), sin.double(), interleaved, r)
    assert_close(qo, ref_q, dtype, what="q")
    assert_close(ko, ref_k, dtype, what="k")
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward([qo, ko], [dq, dk])
    torch.autograd.backward([ref_q, ref_k], [dq.double(), dk.double()])
    assert q.grad.stride() == q.stride()  # no relayout copy when autograd accumulates the gradient
    assert_close(q.grad, q64.grad, dtype, scale=2, what="dq")
    assert_close(k.grad, k64.grad, dtype, scale=2, what="dk")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("partial", [False, True])
def test_rotary_gqa_layouts(dtype, interleaved, partial):
    b, hq, hk, s, d = 2, 6, 2, 5, 24
    rotary_dim = 8 if partial else d
    # [b, s, h, d] projections viewed as [b, h, s, d]: the usual non-contiguous layout
    q = torch.randn(b, s, hq, d, device=DEVICE, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device=DEVICE, dtype=dtype).transpose(1, 2)
    positions = torch.randint(0, 4096, (b, s), device=DEVICE)  # per-sequence position ids (packing)
    cos, sin = _cos_sin(b, s, rotary_dim, dtype, positions)
    _check(q, k, cos, sin, interleaved, None, dtype)


@pytest.mark.parametrize("tokens_per_program", [1, 4])  # 1: the GPU launch; 4: 10 tokens leave a part-filled tile
def test_rotary_any_tokens_per_program(monkeypatch, tokens_per_program):
    from operators.kernels import rope

    monkeypatch.setattr(rope, "tokens_per_program", lambda *_: tokens_per_program)
    b, hq, hk, s, d = 2, 4, 2, 5, 16
    q = torch.randn(b, s, hq, d, device=DEVICE).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device=DEVICE).transpose(1, 2)
    cos, sin = _cos_sin(b, s, 12, torch.float32, torch.randint(0, 4096, (b, s), device=DEVICE))
    _check(q, k, cos, sin, False, None, torch.float32)


def test_rotary_shared_positions_real_head_dim():
    q = torch.randn(1, 4, 3, 128, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(1, 1, 3, 128, device=DEVICE, dtype=torch.bfloat16)
    cos, sin = _cos_sin(1, 3, 128, torch.float32)
    _check(q, k, cos, sin, False, 128, torch.bfloat16)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ],
)
def test_rotary_matches_hf_with_config_scaling(rope_parameters):
    """cos/sin from HF's rotary module (scaling read from the config) rotate q/k exactly as HF does."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters=rope_parameters,
    )
    rotary = LlamaRotaryEmbedding(config).to(DEVICE)
    q = torch.randn(2, 4, 6, 64, device=DEVICE)
    k = torch.randn(2, 2, 6, 64, device=DEVICE)
    position_ids = torch.randint(0, 400, (2, 6), device=DEVICE)
    cos, sin = rotary(q, position_ids)
    ours_q, ours_k = apply_rotary(q, k, cos, sin)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert_close(ours_q, hf_q, torch.float32)
    assert_close(ours_k, hf_k, torch.float32)


def test_rotary_rejects_bad_shapes():
    q = torch.randn(1, 2, 3, 8, device=DEVICE)
    cos, sin = _cos_sin(1, 3, 8, torch.float32)
    with pytest.raises(ValueError):
        apply_rotary(q, q, cos[..., :6], sin[..., :6], rotary_dim=8)
    with pytest.raises(ValueError):
        apply_rotary(q, torch.randn(1, 2, 4, 8, device=DEVICE), cos, sin)
