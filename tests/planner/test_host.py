"""Host cost: the op counts the time model charges against transformers' own layers, and the microbenchmark."""

from __future__ import annotations

import pytest
import torch

from parallel_planner.dispatch import MESH_RANKS, DispatchCosts, _count_ops, measure_dispatch_costs
from parallel_planner.profile import profile_model


def _counted_ops_per_layer(model_type: str, **extra) -> float:
    """Aten ops one decoder layer adds to a forward + backward, counted on tiny models of 2 and 4 layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    counts = []
    for layers in (2, 4):
        config = AutoConfig.for_model(
            model_type,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=layers,
            vocab_size=128,
            **extra,
        )
        config._attn_implementation = "sdpa"
        model = AutoModelForCausalLM.from_config(config)
        ids = torch.randint(0, 128, (1, 16))
        counts.append(_count_ops(torch, lambda model=model, ids=ids: model(input_ids=ids, labels=ids).loss.backward()))
    return (counts[1] - counts[0]) / 2


@pytest.mark.parametrize("model_type, extra", [("llama", {}), ("qwen3", {"head_dim": 16})])
def test_host_op_count_matches_transformers_layers(model_type, extra, tmp_path):
    from transformers import AutoConfig

    from adapt.model.intake import inspect

    AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=128,
        **extra,
    ).save_pretrained(tmp_path)
    block = profile_model(inspect(str(tmp_path), config_only=True)).blocks[0]
    counted = _counted_ops_per_layer(model_type, **extra)
    assert block.host_ops == pytest.approx(counted, rel=0.05), (block.host_ops, counted)
    assert block.host_ops_fused < 0.7 * block.host_ops


@pytest.mark.slow
def test_dispatch_microbenchmark_measures_every_mode():
    torch.manual_seed(0)
    costs = measure_dispatch_costs("cpu", repeats=5)
    assert isinstance(costs, DispatchCosts)
    assert 0 < costs.eager_s < 1e-2 and costs.dtensor_s > costs.eager_s
    assert "torch" in costs.source and costs.source.endswith(f"DTensor on {MESH_RANKS} ranks")
    import torch.distributed as dist

    assert not dist.is_initialized()  # the fake group it made is gone again
