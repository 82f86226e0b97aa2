"""Rotary embedding written as a complex product (Llama 4's ``view_as_complex(q) * freqs_cis``): found by its
numbers as an interleaved rotation, and run as traced with the reason, since the rope kernel takes cos/sin tables."""

from __future__ import annotations

import pytest
import torch
from ops_testlib import CPU
from torch import nn

from adapt.model.intake import describe_model
from operators import plan_kernels, recognise
from operators.agreement import compare_with_spec
from operators.inventory import trace_model
from operators.profiles import load_profile
from operators.providers.adapt_triton import AdaptTritonProvider
from operators.providers.torch_native import TorchNativeProvider
from operators.recognition.rotary_probes import probe_rotary_application

HEADS, SPAN = 4, 16


def turn_bshd(xq: torch.Tensor, xk: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's: heads after positions, the table ``[b, s, d/2]`` broadcast over heads, float32 inside."""
    q_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    return (
        torch.view_as_real(q_ * freqs[:, :, None, :]).flatten(3).type_as(xq),
        torch.view_as_real(k_ * freqs[:, :, None, :]).flatten(3).type_as(xk),
    )


def turn_bhsd(xq: torch.Tensor, xk: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same product on ``[b, h, s, d]`` heads."""

    def one(x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * freqs[:, None]).flatten(3)

    return one(xq), one(xk)


def turn_backwards(xq: torch.Tensor, xk: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A look-alike: the conjugate table turns every pair the other way."""

    def one(x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs.conj()[:, :, None, :]).flatten(3)

    return one(xq), one(xk)


class Turned(nn.Module):
    """Attention whose q and k a global function turns by a complex table it is given."""

    def __init__(self, turn) -> None:
        super().__init__()
        self.qkv, self.out, self.turn = nn.Linear(32, 3 * HEADS * SPAN, bias=False), nn.Linear(HEADS * SPAN, 32), turn

    def forward(self, h: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = (t.view(b, s, HEADS, SPAN) for t in self.qkv(h).chunk(3, -1))
        if self.turn == "bhsd":
            q, k = turn_bhsd(q.transpose(1, 2), k.transpose(1, 2), freqs)
        else:
            q, k = (turn_bshd if self.turn == "bshd" else turn_backwards)(q, k, freqs)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        mixed = torch.softmax(q @ k.transpose(-1, -2) / SPAN**0.5, -1) @ v.transpose(1, 2)
        return self.out(mixed.transpose(1, 2).reshape(b, s, HEADS * SPAN))


def unit_table(seq: int, pairs: int) -> torch.Tensor:
    angles = torch.arange(seq)[:, None] * 10000 ** (-torch.arange(pairs) / pairs)
    return torch.polar(torch.ones_like(angles), angles)[None]


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_a_complex_product_is_an_interleaved_rotation_in_the_layout_it_is_called_with(layout, rng):
    seq = rng.randrange(5, 12)
    args = (torch.randn(2, seq, 32), unit_table(seq, SPAN // 2))
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    variant, evidence = probe_rotary_application(Turned(layout), args, {}, gen)
    assert variant is not None, evidence
    assert (variant["global"], variant["style"], variant["rotary_dim"], variant["head_dim"]) == (
        f"turn_{layout}",
        "interleaved",
        SPAN,
        SPAN,
    )
    assert (variant["table"], variant["layout"]) == ("complex", layout)


def test_the_conjugate_turn_is_no_rotation_of_the_tables_angles(rng):
    seq = rng.randrange(5, 12)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    variant, reason = probe_rotary_application(
        Turned("backwards"), (torch.randn(2, seq, 32), unit_table(seq, 8)), {}, gen
    )
    assert variant is None and "turn_backwards" in reason and "rotates no pairs" in reason


def test_llama4_rotation_is_recognised_runs_as_traced_with_its_reason_and_agrees_with_intake():
    """A tiny Llama 4: three rotated layers and one without position embedding (its NoPE layer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama4_text", vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
        max_position_embeddings=128, no_rope_layers=[1, 1, 1, 0], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    recognition = recognise(model, trace_model(model))
    rotations = [c for c in recognition.by_kind("rotary_application") if c.confirmed]
    assert [c.module for c in rotations] == [f"model.layers.{i}.self_attn" for i in range(3)]
    v = rotations[0].variant
    assert (v.global_name, v.style, v.table, v.layout, v.rotary_dim) == (
        "apply_rotary_emb",
        "interleaved",
        "complex",
        "bshd",
        16,
    )
    assert [c.variant.rope is not None for c in recognition.by_kind("attention")] == [True, True, True, False]

    plan = plan_kernels(trace_model(model), recognition, load_profile("cuda-hopper"), CPU)
    chosen = [c for c in plan.components if c.kind == "rotary_application" and c.confirmed]
    assert {(c.provider, c.status, c.patch) for c in chosen} == {("torch-native", "native", False)}
    assert all("complex table" in c.note for c in chosen)
    assert AdaptTritonProvider().options(rotations[0], CPU) == []
    assert TorchNativeProvider().options(rotations[0], CPU)[0].status == "native"

    spec = describe_model(model, config)
    assert [b.positional for b in spec.blocks] == ["rope", "rope", "rope", "none"]
    assert not [d for d in compare_with_spec(spec, recognition).disagreements if d.field.startswith("rope")]
