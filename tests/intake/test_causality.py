"""Causal or bidirectional is what the attention's mask does, read from the mask a meta forward builds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from novel_models import TokenStack
from torch import nn

from adapt.model.intake import describe_model
from adapt.model.skeleton import quiet_transformers

SPEC = importlib.util.spec_from_file_location(
    "bench_sweep_tiny", Path(__file__).parents[2] / "benchmarks" / "sweep_tiny.py"
)
sweep = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = sweep
SPEC.loader.exec_module(sweep)


def later_token_moves_earlier_outputs(model: nn.Module, vocab: int, seq: int) -> bool:
    """The numbers' answer, in float64: does changing the last token change any earlier position's logits?"""
    ids = torch.randint(0, vocab, (1, seq))
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1 + torch.randint(0, vocab - 1, ())) % vocab
    with torch.no_grad():
        first, second = (model(input_ids=x, attention_mask=torch.ones_like(x)).logits for x in (ids, changed))
    return not torch.allclose(first[:, :-1], second[:, :-1], rtol=0, atol=1e-12)


# BERT-like stacks whose causal-LM class is causal only when built with is_decoder: some carry an is_causal
# flag on their attention (bert), some none (megatron-bert, rembert, big_bird: the model's mask alone decides).
@pytest.mark.parametrize("model_type", ["megatron-bert", "rembert", "big_bird", "bert"])
@pytest.mark.parametrize("is_decoder", [False, True])
def test_a_bert_like_lm_is_causal_exactly_when_its_mask_hides_later_tokens(model_type, is_decoder, fresh_seed):
    from transformers import AutoModelForCausalLM

    config = sweep.tiny_config(model_type)
    config.is_decoder = is_decoder
    with quiet_transformers():
        real = AutoModelForCausalLM.from_config(config).double().eval()
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        spec = describe_model(skeleton, config)
    bidirectional = later_token_moves_earlier_outputs(real, config.vocab_size, seq=7)
    if is_decoder and bidirectional:  # transformers 5.17 builds some of these bidirectional whatever is_decoder says
        assert model_type != "bert"  # bert's attention carries the flag: it is causal in every supported version
    else:
        assert bidirectional is not is_decoder  # the probe tells the two apart
    assert [b.attention.causal for b in spec.blocks] == [not bidirectional] * len(spec.blocks)
    assert spec.is_causal is not bidirectional
    assert ("bidirectional (encoder) attention" in spec.features) is bidirectional


class _Attention(nn.Module):
    """Attention under names no convention uses, no ``is_causal`` flag: the mask comes from positions."""

    def __init__(self, width: int, heads: int, window: int | None, causal: bool) -> None:
        super().__init__()
        self.mix, self.out, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads
        self.window, self.causal = window, causal

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, w = h.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.mix(h).chunk(3, -1))
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        pos = torch.arange(s, device=h.device)
        gap = pos[:, None] - pos[None, :]
        hidden = (gap < 0) if self.causal else torch.zeros_like(gap, dtype=torch.bool)
        if self.window is not None:
            hidden = hidden | (gap.abs() >= self.window)
        scores = scores.masked_fill(hidden, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, w))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, window: int | None, causal: bool) -> None:
        super().__init__()
        self.norm, self.mixer = nn.LayerNorm(width), _Attention(width, heads, window, causal)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.mixer(self.norm(h))
        return h + self.ff(h)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_hand_written_mask_decides_causality_on_meta_and_real_tensors(causal, device, rng):
    width, heads = rng.choice([32, 48, 64]), rng.choice([2, 4])
    window = rng.choice([None, rng.randrange(2, 6)])
    with torch.device(device):
        model = TokenStack(
            rng.randrange(50, 200), width, [_Block(width, heads, window, causal) for _ in range(2)], generates=True
        )  # claims to generate whatever its mask does: the mask must win
    spec = describe_model(model, model.config)
    assert [b.attention.causal for b in spec.blocks] == [causal, causal]
    assert spec.is_causal is causal


def test_a_classifier_over_a_decoder_is_causal_though_it_cannot_generate(fresh_seed):
    """LlamaForSequenceClassification has no generation head, yet its attention masks the future."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    with quiet_transformers(), torch.device("meta"):
        skeleton = LlamaForSequenceClassification(config)
    assert not skeleton.can_generate()
    spec = describe_model(skeleton, config)
    assert spec.is_causal and all(b.attention.causal for b in spec.blocks)
