"""torch's FLOP counter sees through adapt's operators: an adapted model's training step counts the same FLOPs as
the model it adapts (the GEMMs inside the fused unit + down projection, the loss head and the experts included)."""

from __future__ import annotations

import pytest
import torch
from ops_testlib import planned
from torch.utils.flop_counter import FlopCounterMode

from adapt.model.skeleton import loop_experts
from operators import apply_kernel_plan
from operators.registry import Target

CPU = Target("cpu", "float32", True, None, prefer=["adapt-triton"])


def step_flops(model, ids) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_an_adapted_training_step_counts_the_flops_of_the_model_it_adapts(zoo, family):
    model, plan = planned(str(zoo(family)), target=CPU)
    patched_kinds = {c.kind for c in plan.components if c.patch}
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    own = getattr(model.config, "_experts_implementation", None)
    loop_experts(model)  # transformers' grouped experts GEMM has no FLOP formula in torch's counter; its loop has
    try:
        plain = step_flops(model, ids)
    finally:
        if own is not None:
            model.set_experts_implementation(own)
    with apply_kernel_plan(model, plan):
        adapted = step_flops(model, ids)
    assert "lm_head_cross_entropy" in patched_kinds and ({"gated_mlp", "moe"} & patched_kinds), patched_kinds
    assert adapted == plain > 0
