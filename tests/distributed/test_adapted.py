"""Which parts of the kernel plan each layout runs, and why the rest is left out (no process group)."""

from __future__ import annotations

import pytest
import torch

from adapt.core.errors import BadInput
from adapt.runtime.adapted import (
    AdaptOptions,
    local_row_modules,
    restrict_kernel_plan,
)
from parallel_planner.plan import ParallelPlan


@pytest.fixture(scope="module")
def llama_plan(zoo):
    """The zoo Llama and the operators stage's float32 training plan for it on this machine."""
    from transformers import AutoModelForCausalLM

    from operators import load_profile, plan_kernels, recognise
    from operators.inventory import trace_model
    from operators.registry import Target

    model = AutoModelForCausalLM.from_pretrained(zoo("llama"), dtype=torch.float32)
    inventory = trace_model(model)
    plan = plan_kernels(inventory, recognise(model, inventory), load_profile("cuda-hopper"), Target.here())
    assert {"rms_norm", "lm_head_cross_entropy", "residual_add_norm"} <= {c.kind for c in plan.components if c.patch}
    return model, plan


def _kinds(plan) -> set[str]:
    return {c.kind for c in plan.components}


def test_one_rank_eager_keeps_every_patched_component(llama_plan):
    model, plan = llama_plan
    kept, left_out = restrict_kernel_plan(plan, model, ParallelPlan(), compiling=False)
    assert left_out == []
    assert len(kept.components) == sum(c.patch for c in plan.components)


@pytest.mark.parametrize(
    ("layout", "compiling", "refused"),
    [
        ({"pp": 2}, False, {"lm_head_cross_entropy"}),
        ({"tp": 2, "sequence_parallel": True}, False, {"lm_head_cross_entropy", "residual_add_norm"}),
        ({"dp_shard": 2}, True, {"residual_add_norm"}),
    ],
)
def test_layout_refusals_are_named_with_a_reason(llama_plan, layout, compiling, refused):
    model, plan = llama_plan
    kept, left_out = restrict_kernel_plan(plan, model, ParallelPlan(**layout), compiling=compiling)
    assert {entry.split(": ")[1] for entry, _ in left_out} == refused
    assert all(reason for _, reason in left_out)
    assert not refused & _kinds(kept) and "rms_norm" in _kinds(kept)


def test_components_of_another_pipeline_stage_are_not_counted_as_refused(llama_plan):
    model, plan = llama_plan
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleDict({"1": layers[1]})  # what a later stage keeps
    try:
        kept, left_out = restrict_kernel_plan(plan, model, ParallelPlan(pp=2), compiling=False)
    finally:
        model.model.layers = layers
    modules = {c.module for c in kept.components}
    assert modules and all(not m.startswith("model.layers.0.") for m in modules)
    assert any(m.startswith("model.layers.1.") for m in modules)
    assert all(not entry.startswith("model.layers.0.") for entry, _ in left_out)


def test_norms_patched_under_tp_run_on_local_rows(llama_plan):
    _, plan = llama_plan
    rows = local_row_modules(plan, ParallelPlan(tp=2), compiling=True)
    assert "model.norm" in rows and "model.layers.0.input_layernorm" in rows
    assert local_row_modules(None, ParallelPlan(tp=2), compiling=True) == frozenset()


def test_unknown_compile_backend_is_bad_input():
    with pytest.raises(BadInput, match="compile backend"):
        AdaptOptions(compile="tensorrt")
