"""A replaceable attention core is claimed only when the plain kernel reproduces the whole module."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from operators.inventory import trace_model
from operators.recognition import recognise


def _tiny(model_type: str, **extra):
    config = AutoConfig.for_model(
        model_type, vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _attention(model):
    recognition = recognise(model, trace_model(model, seq_len=12))
    return next(c for c in recognition.components if c.kind == "attention")


def test_learned_sinks_keep_the_module_off_the_plain_kernel():
    """gpt-oss hands its core per-head sink logits: a kernel that drops them changes the function."""
    attention = _attention(_tiny("gpt_oss", num_local_experts=2, num_experts_per_tok=1, layer_types=["full_attention"]))
    assert attention.variant.hook and attention.variant.sinks
    # The visibility probe ran (it measured the mask): what left the module unconfirmed is the core probe.
    assert attention.variant.causal is not None and attention.variant.seq_len == 12
    assert not attention.confirmed


def test_a_plain_core_is_confirmed_by_the_whole_module():
    attention = _attention(_tiny("llama"))
    # A hooked core is confirmed only once the module with the plain core reproduced its own output and gradients.
    assert attention.variant.hook and attention.confirmed
