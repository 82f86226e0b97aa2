"""Recognised MoE blocks patched onto adapt's Triton MoE kernels (route, permute, grouped GEMM, GLU, unpermute).

Runs the real kernels; without CUDA they run in Triton's interpreter (``TRITON_INTERPRET=1``, set by the
top-level conftest before any kernel module is imported), so token counts stay tiny.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from ops_testlib import recognised
from torch import nn

from operators import apply_kernel_plan, load_profile, plan_kernels
from operators.inventory import trace_callable
from operators.providers import adapt_triton, triton_moe
from operators.recognition import Component, recognise
from operators.recognition.variants import variant_from_dict
from operators.registry import Target

pytest.importorskip("triton")
CPU_TRAIN = Target("cpu", "float32", True, None)


@pytest.fixture(autouse=True)
def every_test_draws_fresh(fresh_seed):
    return fresh_seed


def forward_backward(model: nn.Module, ids: torch.Tensor, aux_loss: bool = False):
    """Logits, load-balancing loss (transformers computes it from router logits its hooks record) and grads."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, **({"output_router_logits": True} if aux_loss else {}))
    aux = out.aux_loss if aux_loss else torch.zeros(())
    (out.logits.double().pow(2).mean() + aux).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), aux.detach(), grads


def assert_grads_match(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rtol: float = 1e-5) -> None:
    assert set(got) == set(ref)
    for name, g in ref.items():
        scale = max(float(g.abs().max()), 1e-12)
        assert float((got[name] - g).abs().max()) <= rtol * scale, name


@pytest.mark.parametrize("family,aux_loss", [("mixtral", True), ("qwen3_moe", True), ("deepseek_v3", False)])
def test_zoo_moe_runs_on_triton_kernels_with_identical_logits_and_gradients(zoo, family, aux_loss):
    model, inventory, recognition = recognised(str(zoo(family)))
    plan = plan_kernels(inventory, recognition, load_profile("cuda-hopper"), CPU_TRAIN)
    moes = [c for c in plan.components if c.kind == "moe"]
    assert moes and all(
        (c.provider, c.kernel, c.status, c.patch) == ("adapt-triton", "moe_grouped_gemm", "fused", True) for c in moes
    )
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 3))
    ref_logits, ref_aux, ref_grads = forward_backward(model, ids, aux_loss)

    handle = apply_kernel_plan(model, plan)
    assert all("forward" in model.get_submodule(c.module).__dict__ for c in moes)
    logits, aux, grads = forward_backward(model, ids, aux_loss)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5 * float(ref_logits.abs().max()))
    torch.testing.assert_close(aux, ref_aux, rtol=1e-6, atol=0.0)
    assert not aux_loss or float(aux) > 0
    assert_grads_match(grads, ref_grads)
    routers = [f"{c.variant.router}.{c.variant.router_weight}" for c in moes]
    assert all(float(grads[r].abs().max()) > 0 for r in routers)  # routing weights carry the router gradient

    handle.revert()
    assert not any("forward" in model.get_submodule(c.module).__dict__ for c in moes)
    assert model.state_dict().keys() == state.keys() and all(
        torch.equal(model.state_dict()[k], v) for k, v in state.items()
    )
    again, _, _ = forward_backward(model, ids)
    assert torch.equal(again, ref_logits)


def test_grouped_gemm_is_on_the_patched_path(zoo, monkeypatch):
    """Poison the grouped GEMM entry point: the patched model must hit it, the reverted one must not."""
    from operators import kernels

    model, inventory, recognition = recognised(str(zoo("qwen3_moe")))
    plan = plan_kernels(inventory, recognition, load_profile("cuda-hopper"), CPU_TRAIN)

    def poisoned(*args, **kwargs):
        raise RuntimeError("grouped_gemm reached")

    monkeypatch.setattr(kernels, "grouped_gemm", poisoned)
    ids = torch.randint(0, model.config.vocab_size, (1, 4))
    with apply_kernel_plan(model, plan), torch.no_grad(), pytest.raises(RuntimeError, match="grouped_gemm reached"):
        model(input_ids=ids)
    with torch.no_grad():
        model(input_ids=ids)  # native path after revert


# ---------------------------------------------------------------------------------------------------
# A hand-built MoE with every variant the kernels serve off the zoo's beaten track: sigmoid scoring with
# a router bias and a selection bias, grouped top-k, k=3, exact-GELU experts with up before gate, banks
# stored [E, in, out], a routed scale, a shared expert and (hidden, router_logits) outputs; odd sizes.
# ---------------------------------------------------------------------------------------------------

HIDDEN, EXPERTS, INNER, GROUPS, TOPK_GROUP, TOP_K, SCALE = 37, 6, 19, 3, 2, 3, 1.7


class Dispatcher(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(EXPERTS, HIDDEN) / HIDDEN**0.5)
        self.offset = nn.Parameter(0.1 * torch.randn(EXPERTS))
        self.register_buffer("nudge", 0.05 * torch.randn(EXPERTS))

    def forward(self, x):
        logits = F.linear(x, self.table, self.offset)
        scores = torch.sigmoid(logits)
        choice = scores + self.nudge
        grouped = choice.view(-1, GROUPS, EXPERTS // GROUPS)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(TOPK_GROUP, dim=-1).indices, 1.0)
        choice = choice.masked_fill(keep.repeat_interleave(EXPERTS // GROUPS, dim=1) == 0, float("-inf"))
        self.last_choice = (group_scores.detach(), choice.detach())
        ids = choice.topk(TOP_K, dim=-1).indices
        weights = scores.gather(1, ids)
        return logits, SCALE * weights / (weights.sum(-1, keepdim=True) + 1e-20), ids


class Common(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (
            nn.Linear(HIDDEN, 11, bias=False),
            nn.Linear(HIDDEN, 11, bias=False),
            nn.Linear(11, HIDDEN, bias=False),
        )

    def forward(self, x):
        return self.c(F.silu(self.a(x)) * self.b(x))


class Bazaar(nn.Module):
    """Dense float reference MoE: every expert on every token, then the chosen ones gathered and weighted."""

    def __init__(self, jitter: float = 0.0):
        super().__init__()
        self.jitter = jitter  # multiplicative input noise in training mode, as Mixtral's router_jitter_noise
        self.dispatch = Dispatcher()
        self.fuse = nn.Parameter(torch.randn(EXPERTS, HIDDEN, 2 * INNER) / HIDDEN**0.5)  # [E, in, out]
        self.drain = nn.Parameter(torch.randn(EXPERTS, INNER, HIDDEN) / INNER**0.5)  # [E, in, out]
        self.common = Common()

    def forward(self, hidden):
        if self.training and self.jitter:
            hidden = hidden * (1.0 + self.jitter * torch.randn_like(hidden))
        x = hidden.reshape(-1, HIDDEN)
        logits, weights, ids = self.dispatch(x)
        up, gate = torch.einsum("th,ehn->ten", x, self.fuse).chunk(2, dim=-1)
        every = torch.einsum("ten,enh->teh", F.gelu(gate) * up, self.drain)
        chosen = every.gather(1, ids.unsqueeze(-1).expand(-1, -1, HIDDEN))
        routed = (weights.unsqueeze(-1) * chosen).sum(1).view(hidden.shape)
        return routed + self.common(hidden), logits


class Host(nn.Module):
    def __init__(self, jitter: float = 0.0):
        super().__init__()
        self.moe = Bazaar(jitter)

    def forward(self, x):
        return self.moe(x)


def routing_margin(module: Bazaar, x: torch.Tensor) -> float:
    """Smallest gap at the group and expert selection boundaries (float64): near-ties may route differently."""
    with torch.no_grad():
        module(x)
    group_scores, choice = module.dispatch.last_choice
    groups = group_scores.sort(dim=-1, descending=True).values
    experts = choice.sort(dim=-1, descending=True).values
    return float(
        torch.minimum(
            groups[:, TOPK_GROUP - 1] - groups[:, TOPK_GROUP], experts[:, TOP_K - 1] - experts[:, TOP_K]
        ).min()
    )


@pytest.mark.parametrize("call_router", [True, False], ids=["router-module-call", "router-weights-only"])
def test_recognised_hand_built_moe_matches_float64_reference(call_router):
    host = Host()
    recognition = recognise(host, trace_callable(host, torch.randn(2, 3, HIDDEN)))
    (moe,) = [c for c in recognition.components if c.kind == "moe"]
    v = moe.variant
    assert moe.confirmed and triton_moe.unsupported_reason(v) is None
    assert (v.router_bias, v.correction_bias, v.outputs) == ("offset", "nudge", "hidden+router_logits")
    assert (v.gate_up_bank, v.gate_up_layout, v.down_bank, v.down_layout) == (
        "moe.fuse",
        "in_out",
        "moe.drain",
        "in_out",
    )
    assert (v.gate_first, v.activation, v.scoring, v.top_k, v.n_group, v.topk_group) == (
        False,
        "gelu",
        "sigmoid",
        3,
        3,
        2,
    )
    assert v.routed_scale == pytest.approx(SCALE) and v.shared_experts == "moe.common"
    assert v.router_logits_output == 0  # first of the Dispatcher's (logits, weights, ids)
    assert v.stochastic_in_training is False
    if not call_router:  # as for a router that does not return its logits: projection from its parameters
        v = dataclasses.replace(v, router_logits_output=None)

    reference = Host().double()
    reference.load_state_dict({k: t.double() for k, t in host.state_dict().items()})
    x = torch.randn(2, 5, HIDDEN)
    while routing_margin(reference.moe, x.double()) < 1e-3:
        x = torch.randn(2, 5, HIDDEN)
    x64 = x.double().requires_grad_()
    ref_out, ref_logits = reference.moe(x64)
    (ref_out.pow(2).sum() + ref_logits.sum()).backward()

    host.zero_grad(set_to_none=True)  # tracing ran a backward
    forward = triton_moe.moe_forward(host.moe, Component(moe.module, "moe", v, True))
    x32 = x.clone().requires_grad_()
    out, logits = forward(x32)
    (out.double().pow(2).sum() + logits.double().sum()).backward()
    torch.testing.assert_close(out.double(), ref_out.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits.double(), ref_logits.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)
    ref_params = dict(reference.moe.named_parameters())
    for name, param in host.moe.named_parameters():
        assert param.grad is not None and float(param.grad.abs().max()) > 0, name
        torch.testing.assert_close(param.grad.double(), ref_params[name].grad, rtol=1e-4, atol=1e-4, msg=name)


def test_unservable_variants_get_no_option_and_stay_native(zoo):
    _, _, recognition = recognised(str(zoo("deepseek_v3")))
    base = next(c for c in recognition.components if c.kind == "moe")
    provider = adapt_triton.AdaptTritonProvider()
    assert [o.kernel for o in provider.options(base, CPU_TRAIN)] == ["moe_grouped_gemm"]
    for change, reason in [
        ({"activation": "relu"}, "no GLU kernel"),
        ({"group_score": "max"}, "two best experts"),
        ({"outputs": "other"}, "reproduces only"),
        ({"scoring": "softplus"}, "scoring"),
    ]:
        variant = dataclasses.replace(base.variant, **change)
        assert reason in triton_moe.unsupported_reason(variant)
        component = Component(base.module, "moe", variant, True)
        assert provider.options(component, CPU_TRAIN) == []
    older = {k: w for k, w in base.variant.to_dict().items() if k != "gate_up_layout"}  # written before the field
    old = Component(base.module, "moe", variant_from_dict("moe", older), True)
    assert provider.options(old, CPU_TRAIN) == [] and "gate_up_layout" in triton_moe.unsupported_reason(old.variant)


def test_training_time_noise_keeps_the_module_native_for_training_only():
    """Input jitter in training mode is outside the recognised (eval-mode) function: no kernel for training."""
    host = Host(jitter=0.1).eval()
    (moe,) = [c for c in recognise(host, trace_callable(host, torch.randn(2, 3, HIDDEN))).components if c.kind == "moe"]
    assert moe.confirmed and moe.variant.stochastic_in_training is True
    provider = adapt_triton.AdaptTritonProvider()
    assert provider.options(moe, CPU_TRAIN) == []
    assert "random in training mode" in triton_moe.unsupported_reason(moe.variant, training=True)
    inference = Target("cpu", "float32", False, None)
    assert [o.kernel for o in provider.options(moe, inference)] == ["moe_grouped_gemm"]


def test_self_test_catches_a_wrong_moe_kernel(monkeypatch):
    """0.1% off in the routed experts fails the MoE case (it runs last: every other case passes)."""
    real = triton_moe.routed_experts
    monkeypatch.setattr(triton_moe, "routed_experts", lambda *a, **k: real(*a, **k) * 1.001)
    assert adapt_triton._self_test("cpu") == "moe: result differs from PyTorch"
