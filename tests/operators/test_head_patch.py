"""Fused linear cross-entropy on the causal-LM forward: HF's loss and gradients without the logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ops_testlib import count_kernel_calls, load, planned, recognised

from operators import apply_kernel_plan, kernels
from operators.recognition.head_probe import probe_lm_head_loss
from operators.registry import Target

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels in Triton's CPU interpreter")

CPU = Target("cpu", "float32", True, None)


def head_plan(path: str):
    """The family's plan reduced to its loss choice, so only the fused loss differs from the model."""
    model, plan = planned(path, target=CPU)  # (planning may run the provider's self-test of the kernel once)
    return model, dataclasses.replace(
        plan, components=[c for c in plan.components if c.kind == "lm_head_cross_entropy"]
    )


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every call of the fused loss kernel entry point."""
    return count_kernel_calls(monkeypatch, "fused_linear_cross_entropy", lambda args, kwargs: kwargs.get("reduction"))


def batch(vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 13))
    labels = torch.where(torch.rand(ids.shape) < 0.3, -100, torch.randint(0, vocab, ids.shape))
    labels[0, -1] = 5  # the last position's label is dropped by the shift, ignored or not
    return ids, labels


def loss_and_grads(model, **inputs) -> tuple[object, torch.Tensor, dict[str, torch.Tensor]]:
    out = model(**inputs, use_cache=False)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(out.loss, list(params.values()), allow_unused=True)
    return out, out.loss.detach(), {n: g for n, g in zip(params, grads) if g is not None}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "deepseek_v3"])
def test_fused_loss_equals_hf_loss_and_gradients(zoo, family, kernel_calls):
    model, plan = head_plan(str(zoo(family)))
    kernel_calls.clear()
    (choice,) = plan.components
    assert (choice.provider, choice.kernel, choice.status, choice.patch, choice.confirmed) == (
        "adapt-triton",
        "fused_linear_cross_entropy",
        "fused",
        True,
        True,
    )
    assert (choice.variant.final_softcap is not None) == (family == "gemma2")
    ids, labels = batch()
    _, ref_loss, ref_grads = loss_and_grads(model, input_ids=ids, labels=labels)
    with torch.no_grad():
        ref_logits = model(input_ids=ids).logits
    with apply_kernel_plan(model, plan):
        out, loss, grads = loss_and_grads(model, input_ids=ids, labels=labels)
        assert out.logits is None and "logits" not in out  # the point: no [tokens, vocab] tensor returned
        assert kernel_calls == ["mean"]
        with torch.no_grad():
            plain = model(input_ids=ids).logits  # without labels the original forward runs
        assert kernel_calls == ["mean"] and torch.equal(plain, ref_logits)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert "forward" not in model.__dict__ and "_loss_function" not in vars(model)


def test_num_items_in_batch_and_shift_labels_follow_hf(zoo, kernel_calls):
    model, plan = head_plan(str(zoo("llama")))
    ids, labels = batch()
    items = torch.tensor(17)
    shifted = torch.randint(0, 256, ids.shape)
    shifted[1, :4] = -100
    with torch.no_grad():
        want = [
            model(input_ids=ids, labels=labels, num_items_in_batch=items).loss,
            model(input_ids=ids, labels=labels, shift_labels=shifted).loss,
        ]
        with apply_kernel_plan(model, plan):
            got = [
                model(input_ids=ids, labels=labels, num_items_in_batch=items).loss,
                model(input_ids=ids, labels=labels, shift_labels=shifted).loss,
            ]
    assert kernel_calls == ["sum", "mean"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=0)


def test_moe_auxiliary_loss_is_still_added(zoo):
    model, plan = head_plan(str(zoo("mixtral")))
    ids, labels = batch()
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels, output_router_logits=True)
        plain = model(input_ids=ids, labels=labels).loss
        with apply_kernel_plan(model, plan):
            got = model(input_ids=ids, labels=labels, output_router_logits=True)
    assert want.aux_loss is not None and not torch.allclose(want.loss, plain)  # the aux term is really there
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.aux_loss, want.aux_loss)


def test_poisoned_kernel_proves_it_is_on_the_path(zoo, monkeypatch):
    model, plan = head_plan(str(zoo("qwen3")))
    ids, labels = batch()

    def poisoned(*args, **kwargs):
        raise RuntimeError("fused loss kernel reached")

    monkeypatch.setattr(kernels, "fused_linear_cross_entropy", poisoned)
    model(input_ids=ids, labels=labels)  # unpatched: HF's own loss
    with apply_kernel_plan(model, plan):
        model(input_ids=ids)  # no labels: the original forward, no kernel
        with pytest.raises(RuntimeError, match="fused loss kernel reached"):
            model(input_ids=ids, labels=labels)
        assert model(input_ids=ids).logits is not None  # the failed call left no capture behind
    assert "_loss_function" not in vars(model) and not model.get_decoder()._forward_hooks  # undone by the revert


def test_probe_rejects_a_wrong_soft_cap_and_models_without_the_hooks(zoo):
    model, _, recognition = recognised(str(zoo("gemma2")))
    (head,) = recognition.by_kind("lm_head_cross_entropy")
    assert head.confirmed and head.variant.final_softcap == 30.0
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    confirmed, reason = probe_lm_head_loss(model, head.module, None, gen)  # gemma2 without its soft-cap
    assert not confirmed and "differs from the model's own" in reason
    assert not any(p.grad is not None for p in model.parameters())  # the probe leaves no gradients behind
    # A model whose forward cannot skip its logits gets no fused loss: its loss head is rejected, and the
    # projection alone is what recognition claims, on the native path.
    _, _, custom = recognised(str(zoo("custom")))
    assert not custom.by_kind("lm_head_cross_entropy")
    (rejection,) = [r for r in custom.rejected if r["candidate"] == "lm_head_cross_entropy"]
    assert "logits_to_keep" in rejection["reason"]
    (head,) = custom.by_kind("vocab_projection")
    assert head.confirmed and head.module == rejection["module"]
    _, plan = planned(str(zoo("custom")), target=CPU)
    assert plan.component(head.module, "vocab_projection").provider == "torch-native"


def test_trainer_uses_the_fused_loss_and_trains_like_the_unpatched_model(zoo, kernel_calls):
    """adapt's trainer (bench and soak run through it) hands labels to a fused-loss head: the kernel runs
    every step and the loss curve equals the unpatched model's, which computes cross-entropy from logits."""
    from validators.session import prepare_run

    _, plan = head_plan(zoo("llama"))
    curves = {}
    for patched in (False, True):
        model = load(zoo("llama"))  # fresh weights: training must not touch the session's cached model
        handle = apply_kernel_plan(model, plan) if patched else None
        run = prepare_run(model, seq_len=12, batch=2, precision="fp32", steps=3, seed=0, deterministic=True)
        before = len(kernel_calls)
        curves[patched] = [step.loss for step in run.trainer.fit(3).steps]
        assert (len(kernel_calls) - before == 3) == patched
        if handle:
            handle.revert()
    assert torch.allclose(torch.tensor(curves[True]), torch.tensor(curves[False]), rtol=1e-5, atol=1e-6), curves
