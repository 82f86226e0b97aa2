"""Rotary embedding through adapt-triton's ``apply_rotary``: found numerically, dispatched per module, reverted exactly."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from ops_testlib import count_kernel_calls, load, planned
from torch import nn

from operators import apply_kernel_plan, kernels
from operators.providers.triton_rope import rotary_dispatcher
from operators.recognition.rotary_probes import forward_function, probe_rotary_application
from operators.registry import Target

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels in Triton's CPU interpreter")

CPU = Target("cpu", "float32", True, None)
FAMILIES = {
    "llama": "half",
    "qwen3": "half",
    "gemma2": "half",
    "deepseek_v3": "deinterleaved",
    "glm_partial": "interleaved",
}


@pytest.fixture(scope="session")
def checkpoint(zoo, tmp_path_factory):
    """Zoo families, plus GLM (no zoo family has partial rotary): interleaved pairs on 8 of 16 head dims."""

    def get(name: str) -> str:
        if name != "glm_partial":
            return str(zoo(name))
        out = tmp_path_factory.getbasetemp() / "glm_partial"
        if not out.exists():
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.for_model(
                "glm",
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                partial_rotary_factor=0.5,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=1,
            )
            AutoModelForCausalLM.from_config(config).save_pretrained(out)
        return str(out)

    return get


def rope_plan(path: str):
    """The family's plan reduced to its rotary choices, so only the rope patch differs from the model."""
    model, plan = planned(path, target=CPU)
    return model, dataclasses.replace(plan, components=[c for c in plan.components if c.kind == "rotary_application"])


def attention_modules(model: nn.Module, plan) -> list[nn.Module]:
    return [model.get_submodule(c.module) for c in plan.components]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every call of the rope kernel entry point."""
    return count_kernel_calls(monkeypatch, "apply_rotary", lambda args, kwargs: args[0].shape)


def forward_backward(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    (logits * torch.randn(logits.shape, generator=torch.Generator().manual_seed(int(ids.sum())))).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_rope_matches_the_model_and_reverts(checkpoint, family, kernel_calls):
    model, plan = rope_plan(checkpoint(family))
    kernel_calls.clear()  # (planning may run the provider's self-test of this rotation style once)
    choices = plan.components
    assert choices and {(c.provider, c.status, c.patch, c.variant.style) for c in choices} == {
        ("adapt-triton", "fused", True, FAMILIES[family])
    }
    assert all(c.variant.rotary_dim < c.variant.head_dim for c in choices) == (family == "glm_partial")
    attn = attention_modules(model, plan)
    scope, name = forward_function(attn[0]).__globals__, choices[0].variant.global_name
    original = scope[name]
    ids = torch.randint(0, 256, (2, 11))
    ref_logits, ref_grads = forward_backward(model, ids)
    assert not kernel_calls
    with apply_kernel_plan(model, plan):
        assert scope[name] is not original and scope[name].adapt_original is original
        logits, grads = forward_backward(model, ids)
    assert len(kernel_calls) == len(attn)  # one launch per attention layer: q and k together
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for key, grad in ref_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)
    assert scope[name] is original  # the modelling module's global, by identity
    assert all("forward" not in m.__dict__ for m in attn)
    assert torch.equal(forward_backward(model, ids)[0], ref_logits)


def test_unpatched_model_in_the_same_process_never_runs_the_kernel(zoo, kernel_calls):
    """Alignment runs a reference and a candidate of the same class side by side: they share the global."""
    path = str(zoo("llama"))
    patched, plan = rope_plan(path)
    kernel_calls.clear()  # (planning may run the provider's self-test of this rotation style once)
    reference = load(path)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        before = reference(input_ids=ids).logits
        with apply_kernel_plan(patched, plan):
            during = reference(input_ids=ids).logits
            assert not kernel_calls
            patched(input_ids=ids)
            assert len(kernel_calls) == len(plan.components)
    assert torch.equal(before, during)


def test_global_swap_is_reference_counted_across_models(zoo):
    path = str(zoo("qwen3"))
    first, plan = rope_plan(path)
    second = load(path)
    scope = forward_function(attention_modules(first, plan)[0]).__globals__
    name = plan.components[0].variant.global_name
    original = scope[name]
    one = apply_kernel_plan(first, plan)
    two = apply_kernel_plan(second, plan)
    one.revert()
    assert scope[name] is not original  # the second model still needs the dispatcher
    one.revert()  # idempotent: must not release the second model's hold
    assert scope[name] is not original
    two.revert()
    assert scope[name] is original


def test_poisoned_kernel_proves_it_is_on_the_path(zoo, monkeypatch):
    model, plan = rope_plan(str(zoo("deepseek_v3")))
    ids = torch.randint(0, 256, (1, 7))

    def poisoned(*args, **kwargs):
        raise RuntimeError("rope kernel reached")

    monkeypatch.setattr(kernels, "apply_rotary", poisoned)
    model(input_ids=ids)  # unpatched: the kernel is not on the path
    with apply_kernel_plan(model, plan), pytest.raises(RuntimeError, match="rope kernel reached"):
        model(input_ids=ids)


def test_plan_json_shows_rope_fused_by_adapt_triton(zoo):
    _, plan = planned(str(zoo("gemma2")), target=CPU)
    data = json.loads(json.dumps(plan.to_dict()))
    rope = [c for c in data["components"] if c["kind"] == "rotary_application"]
    attention = [c["module"] for c in data["components"] if c["kind"] == "attention"]
    assert [c["module"] for c in rope] == attention
    assert all(
        c["provider"] == "adapt-triton" and c["status"] == "fused" and c["kernel"] == "apply_rotary (half)"
        for c in rope
    )
    assert all(c["variant"]["function"].endswith(".apply_rotary_pos_emb") and c["confirmed"] for c in rope)
    # the attention module's own decision still owns its traced ops
    owners = {o.status for o in plan.ops if any(m.startswith(attention[0]) for m in o.modules)}
    assert owners <= {"fused", "native"}


# ---------------------------------------------------------------------------------------------
# Probe on hand-written attention modules: look-alikes and unverified call signatures get no patch
# ---------------------------------------------------------------------------------------------


def rotate_pairs(q, k, cos, sin, unsqueeze_dim=1):
    """Interleaved pairs rotated in place (GPT-J style), tables in cat(f, f) layout."""
    c, s = (
        cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim),
        sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim),
    )

    def one(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)

    return one(q), one(k)


def almost_rotate(q, k, cos, sin):
    """A look-alike: the sine enters with the wrong sign."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    half = q.shape[-1] // 2

    def one(x):
        return x * c + torch.cat((x[..., half:], -x[..., :half]), dim=-1) * s

    return one(q), one(k)


class TinyAttention(nn.Module):
    def __init__(self, rotation, unsqueeze_dim: int | None = None):
        super().__init__()
        self.qk = nn.Linear(32, 64, bias=False)
        self.out = nn.Linear(16, 32, bias=False)
        self.rotation, self.unsqueeze_dim = rotation, unsqueeze_dim

    def forward(self, h, cos, sin):
        b, s, _ = h.shape
        q, k = self.qk(h).view(b, s, 4, 16).transpose(1, 2).chunk(2, dim=1)
        if self.rotation == "pairs":
            q, k = rotate_pairs(q, k, cos, sin)
        elif self.rotation == "pairs_bshd":
            q, k = rotate_pairs(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            q, k = almost_rotate(q, k, cos, sin)
        weights = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
        return self.out((weights @ k).sum(1))


def function_as_layer(fn):
    """A function turned into a stateless module that calls it, as the ``kernels`` package does to transformers'
    hub-kernel functions (transformers 5.25 installs it): the modelling module's global is then this instance."""

    class FunctionLayer(nn.Module):
        def forward(self, *args, **kwargs):
            return fn(*args, **kwargs)

    return FunctionLayer()


rotate_pairs_layer = function_as_layer(rotate_pairs)


class LayerAttention(TinyAttention):
    """``TinyAttention("pairs")`` calling its rotation through the module global ``rotate_pairs_layer``."""

    def forward(self, h, cos, sin):
        b, s, _ = h.shape
        q, k = self.qk(h).view(b, s, 4, 16).transpose(1, 2).chunk(2, dim=1)
        q, k = rotate_pairs_layer(q, k, cos, sin)
        weights = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
        return self.out((weights @ k).sum(1))


def test_a_function_wrapped_in_a_stateless_layer_is_recognised_and_dispatched(kernel_calls):
    from operators.providers import triton_rope
    from operators.recognition.rotary_probes import called_function

    assert called_function(rotate_pairs_layer) is rotate_pairs and called_function(nn.Linear(2, 2)) is None
    cos, sin = tables(6, 16)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    variant, evidence = probe_rotary_application(LayerAttention("pairs"), (torch.randn(2, 6, 32), cos, sin), {}, gen)
    assert variant is not None, evidence
    assert (variant["global"], variant["style"]) == ("rotate_pairs_layer", "interleaved")
    dispatch = rotary_dispatcher(rotate_pairs_layer)
    q, k = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    want = rotate_pairs(q, k, cos, sin)
    with triton_rope.running(triton_rope.RotarySpec(rotate_pairs_layer, "interleaved", "m")):
        got = dispatch(q, k, cos, sin)
    assert len(kernel_calls) == 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def tables(seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(seq)[:, None] * 10000 ** (-torch.arange(0, dim, 2) / dim)
    emb = torch.cat([angles, angles], -1)[None]
    return emb.cos(), emb.sin()


def test_probe_finds_interleaved_pairs_and_rejects_look_alikes():
    cos, sin = tables(6, 16)
    args = (torch.randn(2, 6, 32), cos, sin)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    variant, evidence = probe_rotary_application(TinyAttention("pairs"), args, {}, gen)
    assert variant is not None, evidence
    assert (variant["global"], variant["style"], variant["rotary_dim"]) == ("rotate_pairs", "interleaved", 16)
    variant, reason = probe_rotary_application(TinyAttention("almost"), args, {}, gen)
    assert variant is None, reason
    # The same rotate_pairs, called with a keyword whose default is all the probe verified: refused.
    variant, reason = probe_rotary_application(TinyAttention("pairs_bshd"), args, {}, gen)
    assert variant is None, reason


def test_dispatcher_runs_the_kernel_only_for_its_module_and_refuses_unverified_arguments(kernel_calls):
    from operators.providers import triton_rope

    dispatch = rotary_dispatcher(rotate_pairs)
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    cos, sin = tables(5, 16)
    want = rotate_pairs(q, k, cos, sin)
    got = dispatch(q, k, cos, sin)  # no patched module running: the original
    assert not kernel_calls and all(torch.equal(a, b) for a, b in zip(got, want))
    with triton_rope.running(triton_rope.RotarySpec(rotate_pairs, "interleaved", "m")):
        got = dispatch(q, k, cos, sin, unsqueeze_dim=1)
        assert len(kernel_calls) == 1
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        with pytest.raises(RuntimeError, match="unsqueeze_dim=2"):
            dispatch(q, k, cos, sin, unsqueeze_dim=2)
    assert not triton_rope._ACTIVE
    assert math.isfinite(float(got[0].sum()))


def test_custom_model_gets_no_rope_patch(zoo):
    from ops_testlib import recognised

    _, _, recognition = recognised(str(zoo("custom")))
    rope = recognition.by_kind("rotary_application")
    assert [c.module for c in rope] == [c.module for c in recognition.by_kind("attention")] != []
    # No global function its forward calls rotates (q, k): no function, no style, nothing confirmed.
    assert all(not c.confirmed and c.variant.function is None and c.variant.style is None for c in rope)
    _, plan = planned(str(zoo("custom")), target=CPU)
    assert {(c.provider, c.status, c.patch) for c in plan.components if c.kind == "rotary_application"} == {
        (None, "native", False)
    }
