"""A replaceable attention core is claimed only when the plain kernel reproduces the whole module."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from operators.inventory import trace_model
from operators.recognition import recognise
from operators.recognition.attention_probes import attention_core_matches


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


def test_learned_sinks_are_confirmed_only_with_the_sinks_applied():
    """gpt-oss hands its core per-head sink logits (``s_aux``): the kernel that applies them reproduces the module,
    and the same kernel without them does not."""
    model = _tiny("gpt_oss", num_local_experts=2, num_experts_per_tok=1, layer_types=["full_attention"])
    with torch.no_grad():
        model.model.layers[0].self_attn.sinks.normal_(0.0, 2.0)  # sinks that take a real share of each row
    inventory = trace_model(model, seq_len=12)
    attention = next(c for c in recognise(model, inventory).components if c.kind == "attention")
    assert attention.variant.hook and attention.variant.sinks
    # The visibility probe ran (it measured the mask), then the core probe with the sinks applied.
    assert attention.variant.causal is not None and attention.variant.seq_len == 12
    assert attention.confirmed
    module = model.get_submodule(attention.module)
    measured = {"causal": attention.variant.causal, "window": attention.variant.window, "softcap": None}
    generator = torch.Generator().manual_seed(0)
    captured = inventory.captured[attention.module]
    assert attention_core_matches(module, *captured, {**measured, "sinks": True}, generator)[0]
    assert not attention_core_matches(module, *captured, {**measured, "sinks": False}, generator)[0]


def test_a_plain_core_is_confirmed_by_the_whole_module():
    attention = _attention(_tiny("llama"))
    # A hooked core is confirmed only once the module with the plain core reproduced its own output and gradients.
    assert attention.variant.hook and attention.confirmed
