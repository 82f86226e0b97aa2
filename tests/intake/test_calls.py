"""``without_cache``: adapt's own calls turn a model's caches off whichever way the model reads the flag."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from adapt.model.calls import without_cache


class _Config:
    use_cache = True


class _NamesTheFlag(nn.Module):
    def forward(self, input_ids, use_cache=True):
        return input_ids


class _TakesKwargs(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, input_ids, **kwargs):
        return input_ids


class _Plain(nn.Module):
    def forward(self, input_ids):
        return input_ids


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (_NamesTheFlag(), {"use_cache": False}),
        (_TakesKwargs(_Config()), {"use_cache": False}),
        (_TakesKwargs(None), {}),  # **kwargs without a config that carries the flag: no keyword is guessed
        (_Plain(), {}),
    ],
)
def test_the_flag_is_passed_only_to_models_that_read_it(model, expected):
    assert without_cache(model) == expected
    ids = torch.randint(0, 10, (1, 3))
    assert torch.equal(model(ids, **without_cache(model)), ids)


def test_a_stack_of_linear_attention_layers_alone_runs_uncached():
    """transformers 5's default cache for such a stack cannot report a cached length; uncached, the model runs."""
    config = GraniteMoeHybridConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "mamba"], mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16,
        num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=32,
    )  # fmt: skip
    model = GraniteMoeHybridForCausalLM(config).eval()
    assert "use_cache" not in inspect.signature(model.forward).parameters  # read through **kwargs
    assert without_cache(model) == {"use_cache": False}
    ids = torch.randint(0, 64, (2, 5))
    assert model(input_ids=ids, **without_cache(model)).logits.shape == (2, 5, 64)
