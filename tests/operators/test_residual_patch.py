"""The residual add in a block's own code fused with the RMSNorm it feeds (adapt-triton ``add_rms_norm``).

The kernels run in Triton's CPU interpreter.  Each test checks the patched model against the unpatched one
(fp32 logits and every gradient), that the fused kernel's output is what the model uses, the miss
accounting when a block leaves the traced path, and that revert leaves no forward, hook or mode behind.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ops_testlib import count_kernel_calls, planned
from torch import nn

from adapt.model.blocks import find_blocks
from operators import apply_kernel_plan, kernels, load_profile, plan_kernels
from operators.inventory import trace_callable
from operators.recognition import recognise
from operators.registry import Target

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels in Triton's CPU interpreter")

CPU = Target("cpu", "float32", True, None)
# family -> the norm each decoder layer's add feeds (Gemma-2 adds after its sandwich norm, then pre-norms the MLP)
FAMILIES = {
    "llama": "post_attention_layernorm",
    "gemma2": "pre_feedforward_layernorm",
    "deepseek_v3": "post_attention_layernorm",
    "mixtral": "post_attention_layernorm",
    "custom": None,
}


@pytest.fixture(autouse=True)
def every_test_draws_fresh(fresh_seed):
    return fresh_seed


def fusion_plan(path: str):
    """The family's plan reduced to its residual-add + norm choices, so only the fusion differs from the model."""
    model, plan = planned(path, target=CPU)
    return model, dataclasses.replace(plan, components=[c for c in plan.components if c.kind == "residual_add_norm"])


def forward_backward(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits.double() * torch.randn(logits.shape, dtype=torch.float64)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def assert_close(got: tuple, ref: tuple) -> None:
    (logits, grads), (ref_logits, ref_grads) = got, ref
    assert float((logits - ref_logits).abs().max()) <= 1e-5 * max(float(ref_logits.abs().max()), 1.0)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert float((grads[name] - g).abs().max()) <= 1e-5 * max(float(g.abs().max()), 1e-12), name


def patch_state(model: nn.Module) -> list:
    """Instance forwards and hooks of every module: revert must give back exactly what was there."""
    return [("forward" in m.__dict__, list(m._forward_pre_hooks), list(m._forward_hooks)) for m in model.modules()]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_add_norm_matches_the_model_and_reverts(zoo, family, monkeypatch):
    model, plan = fusion_plan(str(zoo(family)))
    choices = plan.components
    layers = len(find_blocks(model))
    assert len(choices) == layers and all(
        (c.provider, c.kernel, c.status, c.patch) == ("adapt-triton", "add_rms_norm", "fused", True) for c in choices
    )
    if FAMILIES[family]:
        assert {c.module.rsplit(".", 1)[1] for c in choices} == {FAMILIES[family]}
    calls = count_kernel_calls(monkeypatch, "add_rms_norm", lambda args, kwargs: args[0].shape)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    state = torch.random.get_rng_state()
    reference = forward_backward(model, ids)
    before = patch_state(model)

    handle = apply_kernel_plan(model, plan)
    torch.random.set_rng_state(state)
    assert_close(forward_backward(model, ids), reference)
    assert len(calls) == layers and handle.residual_fusion() == {
        "pairs": layers,
        "fused": layers,
        "missed": 0,
        "idle": 0,
    }
    assert torch._C._len_torch_function_stack() == 0
    handle.revert()
    assert patch_state(model) == before
    torch.random.set_rng_state(state)
    again = forward_backward(model, ids)
    assert torch.equal(again[0], reference[0]) and len(calls) == layers


def test_the_model_uses_the_kernels_normalised_output(zoo, monkeypatch):
    """Scaling the kernel's normalised output (not the sum) must change the logits: the norm's result comes from it."""
    model, plan = fusion_plan(str(zoo("llama")))
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    real = kernels.add_rms_norm

    def scaled(*args, **kwargs):
        total, normed = real(*args, **kwargs)
        return total, normed * 1.5

    monkeypatch.setattr(kernels, "add_rms_norm", scaled)
    with apply_kernel_plan(model, plan) as handle, torch.no_grad():
        logits = model(input_ids=ids).logits
        assert handle.residual_fusion()["fused"] == len(find_blocks(model))
    assert float((logits - reference).abs().max()) > 1e-2


def test_gradient_checkpointing_recomputes_through_the_fusion(zoo):
    model, plan = fusion_plan(str(zoo("llama")))
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    state = torch.random.get_rng_state()
    reference = forward_backward(model, ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        with apply_kernel_plan(model, plan) as handle:
            torch.random.set_rng_state(state)
            assert_close(forward_backward(model, ids), reference)
            # every layer's forward ran twice (forward, then recomputation in backward), fused both times
            assert handle.residual_fusion() == {"pairs": 2, "fused": 4, "missed": 0, "idle": 0}
    finally:
        model.gradient_checkpointing_disable()
        model.eval()


class Branch(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class Norm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.scale


class Block(nn.Module):
    """A residual block written by hand: one bias add before the residual add, and an optional detour."""

    def __init__(self, width: int = 24):
        super().__init__()
        self.branch, self.norm, self.out = Branch(width), Norm(width), nn.Linear(width, width)
        self.bias = nn.Parameter(0.1 * torch.randn(width))
        self.detour = False

    def forward(self, x):
        h = x + self.bias  # add 0: not fed to the norm
        h = h + self.branch(h)  # add 1: feeds the norm on the traced path
        if self.detour:
            h = h * 1.0
        return self.out(self.norm(h)) + h


def block_plan(block: Block, x: torch.Tensor):
    inventory = trace_callable(block, x)
    plan = plan_kernels(inventory, recognise(block, inventory), load_profile("cuda-hopper"), CPU)
    return dataclasses.replace(plan, components=[c for c in plan.components if c.kind == "residual_add_norm"])


def test_a_block_off_the_traced_path_runs_unfused_and_counts_the_miss():
    block, x = Block(), torch.randn(3, 5, 24)
    plan = block_plan(block, x)
    before = patch_state(block)
    (choice,) = plan.components
    assert (choice.module, choice.variant.add_in, choice.variant.add_after, choice.variant.add_index) == (
        "norm",
        "",
        "branch",
        0,
    )
    reference = block(x)
    with apply_kernel_plan(block, plan) as handle:
        assert torch.allclose(block(x), reference, rtol=1e-5, atol=1e-6)
        assert handle.residual_fusion() == {"pairs": 1, "fused": 1, "missed": 0, "idle": 0}
        block.detour = True
        assert torch.allclose(block(x), reference, rtol=1e-5, atol=1e-6)
        assert handle.residual_fusion() == {"pairs": 1, "fused": 1, "missed": 1, "idle": 0}
        block.detour = False
        block.norm(x)  # the norm called outside its block is neither fused nor a miss
        block.branch(x)  # nor does its opener, called from outside, leave the mode on the stack
        assert torch._C._len_torch_function_stack() == 0
        assert handle.residual_fusion() == {"pairs": 1, "fused": 1, "missed": 1, "idle": 0}
        with pytest.raises(RuntimeError):
            block(x[..., :5])  # fails inside a child: the mode must not stay on the stack
        assert torch._C._len_torch_function_stack() == 0
    assert patch_state(block) == before


def test_operands_the_kernel_cannot_take_run_unfused():
    """float64 has no kernel: the add and the norm run as written, and the norm call counts as a miss."""
    block, x = Block(), torch.randn(3, 5, 24)
    plan = block_plan(block, x)
    block.double()
    reference = block(x.double())
    with apply_kernel_plan(block, plan) as handle:
        assert torch.equal(block(x.double()), reference)
        assert handle.residual_fusion() == {"pairs": 1, "fused": 0, "missed": 1, "idle": 1}


class Shifted(nn.Module):
    """The add feeding the norm runs before any child: no child hook can open a window for it."""

    def __init__(self, width: int = 24):
        super().__init__()
        self.norm, self.out = Norm(width), nn.Linear(width, width)
        self.shift = nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x):
        return self.out(self.norm(x + self.shift))


def test_an_add_before_any_child_is_recognised_but_not_fused():
    module = Shifted()
    x = torch.randn(2, 3, 24)
    inventory = trace_callable(module, x)
    plan = plan_kernels(inventory, recognise(module, inventory), load_profile("cuda-hopper"), CPU)
    (choice,) = [c for c in plan.components if c.kind == "residual_add_norm"]
    assert choice.variant.add_after is None and (choice.status, choice.patch) == ("native", False)


def test_the_patch_check_fails_a_pair_that_never_fuses(zoo, monkeypatch):
    from operators import check_kernel_plan
    from operators.providers import triton_residual

    model, plan = fusion_plan(str(zoo("llama")))
    check = check_kernel_plan(model, plan)
    assert check.passed and check.residual_fusion == {"pairs": 2, "fused": 2, "missed": 0, "idle": 0}
    monkeypatch.setattr(triton_residual, "_fusable", lambda *args: False)
    check = check_kernel_plan(model, plan)
    assert not check.passed and check.residual_fusion["idle"] == 2
