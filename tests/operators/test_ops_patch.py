"""Kernel plans and patching: every family fully mapped, patched logits/gradients match, revert is exact."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ops_testlib import planned

from adapt.core.errors import BadInput
from adapt.model.zoo import ZOO_NAMES
from operators import apply_kernel_plan, check_kernel_plan, load_profile
from operators.mapping import STATUSES

HERE = Path(__file__).parent


@pytest.mark.parametrize("family", [n for n in ZOO_NAMES if n != "custom"])
def test_every_family_is_fully_mapped_and_patches_exactly(zoo, family):
    model, plan = planned(str(zoo(family)))
    coverage = plan.coverage()
    assert coverage["unmapped"] == 0 and coverage["ops_total"] > 0
    assert {o.status for o in plan.ops} <= set(STATUSES)
    assert coverage["flops_share_fused_or_native"] == 1.0
    check = check_kernel_plan(model, plan)
    assert check.passed, check
    assert check.patched_modules == sum(c.patch for c in plan.components)
    if any(c.kind == "rms_norm" for c in plan.components):  # decomposed RMSNorms always get F.rms_norm
        assert check.patched_modules > 0


def test_custom_model_quench_runs_through_an_inductor_kernel(zoo, tmp_path, monkeypatch):
    from operators import api, run_ops

    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path / "cache"))  # cold: no capture from another test's run
    report = run_ops(str(zoo("custom")), out_dir=tmp_path / "cold", onnx=False, trust_remote_code=True)
    data = report.to_dict()
    quench = [c for c in data["components"] if c["kind"] == "new"]
    assert {(c["module"], c["status"], c["provider"]) for c in quench} == {
        ("trunk.strata.0.quench", "generated", "inductor"),
        ("trunk.strata.1.quench", "generated", "inductor"),
    }
    assert [n["module"] for n in data["new"]] == ["trunk.strata.0.quench", "trunk.strata.1.quench"]
    first, second = data["generated"]
    assert first["language"] == "c++/openmp"  # Inductor's CPU backend; Triton on CUDA
    assert any("asinh" in name for name in first["kernels"])
    saved = [Path(f) for f in first["files"]]
    assert saved and all(p.is_file() and p.parent == tmp_path / "cold" / "generated" for p in saved)
    assert data["coverage"]["unmapped"] == 0 and data["patch_check"]["passed"]
    assert json.loads((tmp_path / "cold" / "ops.json").read_text())["coverage"] == data["coverage"]
    # the second stratum's quench is interchangeable with the first: its code is the first's, compiled once
    assert (second["module"], second["reused_from"], second["files"]) == (
        "trunk.strata.1.quench",
        "trunk.strata.0.quench",
        first["files"],
    )
    assert second["compile_seconds"] == 0.0 < first["compile_seconds"] and not first["earlier_run"]

    # a warm run compiles nothing: the captured code comes from adapt's cache, written beside the new report
    def no_compile(*_args, **_kwargs):
        raise AssertionError("a warm run compiled a generated module")

    monkeypatch.setattr(api, "capture_code", no_compile)
    warm = run_ops(str(zoo("custom")), out_dir=tmp_path / "warm", onnx=False, trust_remote_code=True).to_dict()
    assert [(g["module"], g["earlier_run"], g["compile_seconds"]) for g in warm["generated"]] == [
        ("trunk.strata.0.quench", True, 0.0),
        ("trunk.strata.1.quench", True, 0.0),
    ]
    again = [Path(f) for f in warm["generated"][0]["files"]]
    assert [p.parent for p in again] == [tmp_path / "warm" / "generated"] * len(saved)
    assert [p.read_text() for p in again] == [p.read_text() for p in saved]
    assert warm["generated"][0]["kernels"] == first["kernels"]


def test_patched_kernel_really_runs_with_the_plan_parameters(zoo):
    """Poison the plan (eps x 1e6): if the installed kernel is on the path, the logits must change."""
    model, plan = planned(str(zoo("llama")))
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    for choice in plan.components:
        if choice.kind == "rms_norm":
            choice.variant = dataclasses.replace(choice.variant, eps=1.0)
    try:
        with apply_kernel_plan(model, plan), torch.no_grad():
            poisoned = model(input_ids=ids).logits
    finally:
        for choice in plan.components:
            if choice.kind == "rms_norm":
                choice.variant = dataclasses.replace(choice.variant, eps=1e-6)
    assert not torch.allclose(poisoned, ref, atol=1e-3)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)  # reverted on context exit


def test_attention_hook_kernel_is_on_the_path(zoo):
    """DeepSeek-V3's MLA attention is served by SDPA through the model's attention hook; count the calls."""
    model, plan = planned(str(zoo("deepseek_v3")))
    attn = [c for c in plan.components if c.kind == "attention"]
    assert {(c.provider, c.kernel, c.status, c.patch) for c in attn} == {("torch-native", "SDPA", "fused", True)}
    shared = model.config
    handle = apply_kernel_plan(model, plan)
    assert model.model.layers[0].self_attn.config._attn_implementation == "adapt"
    assert shared._attn_implementation != "adapt"  # model-level code keeps its own implementation
    model(input_ids=torch.randint(0, 256, (1, 9)))
    assert handle.attention_calls() == 3
    handle.revert()
    assert all(layer.self_attn.config is shared for layer in model.model.layers)
    assert "forward" not in model.model.layers[0].input_layernorm.__dict__


def test_gemma2_inference_plan_serves_softcapped_attention_with_flex(zoo):
    from operators.registry import Target

    model, plan = planned(str(zoo("gemma2")), target=Target("cpu", "float32", training=False, compute_capability=None))
    attn = [c for c in plan.components if c.kind == "attention"]
    assert {(c.kernel, c.status, c.patch) for c in attn} == {("FlexAttention", "fused", True)}
    check = check_kernel_plan(model, plan)
    assert check.passed and check.attention_kernel_calls == 2, check


def test_gpt_oss_attention_with_sinks_is_served_by_flex_with_its_sinks(tmp_path, fresh_seed):
    """gpt-oss hands its attention core learned per-head sink logits (``s_aux``).  The core probe accepts a kernel
    only if it reproduces them, and FlexAttention then serves the attention with the sinks applied through the
    keys' log-sum-exp: patched logits match the model's own, with sinks drawn large enough to matter."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    from operators.registry import Target

    config = GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # fresh draws: sinks that take a real share of each row
    model.save_pretrained(tmp_path / "gpt_oss")
    model, plan = planned(
        str(tmp_path / "gpt_oss"),
        target=Target("cpu", "float32", training=False, compute_capability=None),
    )
    attn = [c for c in plan.components if c.kind == "attention"]
    assert {(c.kernel, c.status, c.patch) for c in attn} == {("FlexAttention", "fused", True)}
    assert all(c.variant.sinks for c in attn)
    check = check_kernel_plan(model, plan)
    assert check.passed and check.attention_kernel_calls == 2, check
    ids = torch.randint(0, 128, (2, 24))
    long_ids = torch.randint(0, 128, (1, 384))  # three of FlexAttention's 128-token blocks: the window skips some
    with torch.no_grad():
        own = model(input_ids=long_ids).logits
    with apply_kernel_plan(model, plan), torch.no_grad():
        torch.testing.assert_close(model(input_ids=long_ids).logits, own, rtol=1e-4, atol=1e-4)
        served = model(input_ids=ids).logits
        sinks = [layer.self_attn.sinks for layer in model.model.layers]
        kept = [s.clone() for s in sinks]
        for s in sinks:
            s.fill_(-1e4)  # no mass on the sinks: what a kernel that dropped them would compute
        without = model(input_ids=ids).logits
        for s, k in zip(sinks, kept):
            s.copy_(k)
    assert not torch.allclose(served, without, atol=1e-3)  # the sinks matter here, so the check above means something


def test_flex_skips_the_blocks_a_causal_window_hides_only_over_whole_blocks():
    from operators.providers.torch_native import FLEX_BLOCK, _visible_blocks
    from operators.recognition.variants import AttentionVariant

    window = AttentionVariant(causal=True, window=8)
    blocks = _visible_blocks(3 * FLEX_BLOCK, 3 * FLEX_BLOCK, window, "cpu")
    assert blocks is not None and blocks.sparsity() > 40  # 6 causal blocks of 9, of which the window keeps 5
    assert _visible_blocks(3 * FLEX_BLOCK, 3 * FLEX_BLOCK, AttentionVariant(causal=True), "cpu").sparsity() > 30
    assert _visible_blocks(64, 64, window, "cpu") is None  # not whole blocks: the mask alone serves
    assert _visible_blocks(300, 300, window, "cpu") is None
    assert _visible_blocks(3 * FLEX_BLOCK, 3 * FLEX_BLOCK, AttentionVariant(causal=False), "cpu") is None


def test_restricted_profile_decomposes_or_generates_every_missing_op(zoo):
    model, plan = planned(str(zoo("gemma2")), profile="npu-restricted")
    statuses = {o.overload: o for o in plan.ops}
    assert statuses["aten._log_softmax.default"].status == "decomposed"  # loss, via torch._decomp
    assert "aten.exp.default" in statuses["aten._log_softmax.default"].replacement
    rsqrt = statuses["aten.rsqrt.default"]  # no decomposition exists: the owning norms are compiled
    assert rsqrt.status == "generated"
    assert all(c.status == "generated" for c in plan.components if c.kind == "rms_norm")
    unsupported = [o for o in plan.ops if o.status == "unsupported"]
    # only model-level glue (mask building, loss) outside every component stays unsupported, with a reason
    assert all(o.replacement for o in unsupported)
    component_paths = {c.module for c in plan.components}
    assert not any(m in component_paths for o in unsupported for m in o.modules)
    assert plan.coverage()["unmapped"] == 0
    hopper = planned(str(zoo("gemma2")))[1]
    assert {o.status for o in hopper.ops} <= {"fused", "native"}


def test_profile_errors_are_bad_input(tmp_path):
    with pytest.raises(BadInput, match="unknown profile"):
        load_profile("no-such-accelerator")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\n")
    with pytest.raises(BadInput, match="broken.yaml"):
        load_profile(str(broken))


TRITON_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    sys.path.insert(0, {here!r})
    from operators import check_kernel_plan, plan_kernels, recognise, load_profile, Target
    from operators.inventory import trace_model
    from ops_testlib import load
    from operators.providers.adapt_triton import AdaptTritonProvider
    ok, why = AdaptTritonProvider().available(Target("cpu", "float32", True, None))
    if not ok:
        print("UNAVAILABLE", why)
        sys.exit(0)
    model = load({path!r})
    inv = trace_model(model)
    plan = plan_kernels(inv, recognise(model, inv), load_profile("cuda-hopper"),
                        Target("cpu", "float32", True, None, prefer=["adapt-triton"]))
    chosen = sorted({{(c.kind, c.provider, c.kernel) for c in plan.components if c.patch}})
    check = check_kernel_plan(model, plan)
    print(chosen, check.passed, check.logits_max_abs_diff, check.grad_max_rel_diff)
    assert ("gated_mlp", "adapt-triton", "swiglu_linear") in chosen and ("rms_norm", "adapt-triton", "rms_norm") in chosen
    assert check.passed, check
    """
)


def test_adapt_triton_provider_under_the_interpreter(zoo):
    pytest.importorskip("triton")
    script = TRITON_SCRIPT.format(here=str(HERE), path=str(zoo("llama")))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    if result.stdout.startswith("UNAVAILABLE"):  # this Triton's interpreter cannot run the kernel library
        pytest.skip(result.stdout.strip())


def test_triton_provider_declares_itself_unavailable_without_interpreter(monkeypatch):
    from operators.providers.adapt_triton import AdaptTritonProvider
    from operators.registry import Target

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, why = AdaptTritonProvider().available(Target("cpu", "float32", True, None))
    assert not ok and "TRITON_INTERPRET" in why


def _softmax_grads(softmax, x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """float32 gradients of a softmax layer with a shift added to every logit: softmax ignores the shift, so its
    gradient is zero in exact arithmetic and holds only rounding."""
    weight = w.clone().requires_grad_()
    shift = torch.zeros(x.shape[0], 1, requires_grad=True)
    loss = (softmax(x @ weight + shift) * target).sum()
    loss.backward()
    return {"weight": weight.grad, "shift": shift.grad}


def test_gradient_check_reads_rounding_of_a_vanishing_gradient_as_agreement_and_catches_a_changed_kernel(fresh_seed):
    from operators.api import gradient_mismatch

    x, w, target = torch.randn(128, 48), torch.randn(48, 96), torch.randn(128, 96)
    reference = _softmax_grads(lambda z: torch.softmax(z, -1), x, w, target)

    def by_hand(z: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:  # the same function, other rounding
        e = torch.exp((z - z.amax(-1, keepdim=True)) / temperature)
        return e / e.sum(-1, keepdim=True)

    same = _softmax_grads(by_hand, x, w, target)
    assert reference["shift"].abs().max() > 0  # rounding, not an exact zero: the case the floor is for
    assert gradient_mismatch(reference, same) <= 1e-4
    changed = _softmax_grads(lambda z: by_hand(z, 1.001), x, w, target)
    assert gradient_mismatch(reference, changed) > 1e-4
    assert gradient_mismatch(reference, {"weight": same["weight"]}) == float("inf")
