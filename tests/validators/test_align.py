"""Full-mode alignment: every zoo model passes; broken kernels and NaNs are caught and located."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
from helpers import first_norm, poison_output, scale_norm_output, stale_linear_weights, swap_router_rows
from torch import nn

from adapt.model.intake import build_spec, resolve_source
from adapt.model.skeleton import build_skeleton
from adapt.model.zoo import ZOO_NAMES
from validators.align import AlignOptions, _loss_parity, align
from validators.modules import find_blocks
from validators.training import batch_for_step

FAST = AlignOptions(batch=2, seq_len=16, parity_steps=2)
# The same 32 tokens in short rows, for routed models in bf16: a token whose expert choice is undecidable hides the
# loss terms of every later position of its row from the gradients, so short rows keep most terms judgeable.
SHORT_ROWS = dataclasses.replace(FAST, batch=8, seq_len=4)


def _src(zoo, name):
    return resolve_source(str(zoo(name)), trust_remote_code=name == "custom")


@pytest.fixture(scope="module")
def kernel_plans(zoo):
    """The operators stage's kernel plan per zoo model, computed once."""
    from operators import run_ops

    plans = {}

    def get(name):
        if name not in plans:
            plans[name] = run_ops(
                _src(zoo, name), trust_remote_code=name == "custom", onnx=False, check_patch=False
            ).plan
        return plans[name]

    return get


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_model_aligns(zoo, kernel_plans, name, dtype):
    # Fresh inputs every run: MoE tokens on a near-tied router score (expert choice undecidable in bf16)
    # are left out and counted (validators.routing), so no draw is special.
    plan = kernel_plans(name)
    routed = any(block.mlp.kind == "moe" for block in build_spec(_src(zoo, name)).blocks)
    report = align(_src(zoo, name), plan, dtype=dtype, options=SHORT_ROWS if routed and dtype == "bf16" else FAST)
    undecidable = report.inconclusive is not None and "expert choice" in report.inconclusive
    if undecidable and report.first_divergent is None and report.nonfinite_module is None:
        # a tiny random router can leave most expert choices undecidable in bf16 even after the redraws: the verdict
        # is then honestly "inconclusive", and nothing diverged; the draw says nothing about the kernels
        pytest.skip(f"seed {report.seed}: {report.inconclusive}")
    assert report.passed and report.inconclusive is None, (report.seed, report.first_divergent, report.notes)
    assert sorted(entry.split(": ")[0] for entry in report.patched_modules) == sorted(
        c.module for c in plan.components if c.patch
    )
    blocks = {layer.block for layer in report.layers if layer.block is not None}
    assert blocks == set(range(len(find_blocks(build_skeleton(_src(zoo, name))).blocks)))
    assert any(layer.component is not None for layer in report.layers)
    assert report.layers[-1].name == "logits"
    assert report.gradients and all(g.passed for g in report.gradients)
    assert report.parity is not None and report.parity.passed
    assert all(layer.passed and layer.cosine <= 1.0 + 1e-9 for layer in report.layers)
    assert report.layers[-1].cosine > 0.98
    assert bool(report.routing_undecidable) == any(layer.excluded_tokens for layer in report.layers)


def test_loss_parity_runs_in_lockstep_and_catches_a_kernel_that_keeps_stale_weights(zoo, kernel_plans):
    """Step 0 of a stale-weight kernel is exact, so only training can show it; a correct plan agrees at every step
    to about one rounding, since the unadapted model runs at the adapted model's weights."""
    src = _src(zoo, "llama")
    options = dataclasses.replace(FAST, parity_steps=3)
    good = align(src, kernel_plans("llama"), dtype="fp32", options=options)
    assert good.parity.passed and good.parity.max_rel_diff < 1e-5, good.parity
    assert len(good.parity.baseline_grad_norms) == len(good.parity.candidate_grad_norms) == 3
    stale = align(src, dtype="fp32", transform=stale_linear_weights(), options=options)
    assert all(layer.passed for layer in stale.layers) and all(g.passed for g in stale.gradients)
    assert stale.parity.candidate_losses[0] == stale.parity.baseline_losses[0]
    assert not stale.parity.passed and not stale.passed
    assert stale.parity.max_rel_diff > 10 * stale.parity.tolerance, stale.parity


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_router_that_routes_wrongly_fails_in_its_block(zoo, name):
    """Two experts' router rows swapped in block 1: clear-margin flips are judged, never excused."""
    src = _src(zoo, name)
    moe_block = len(find_blocks(build_skeleton(src)).blocks) - 1
    report = align(
        src, dtype="bf16", transform=swap_router_rows(moe_block), options=dataclasses.replace(FAST, parity_steps=0)
    )
    assert not report.passed
    assert report.first_divergent_block == moe_block
    assert report.routing_clear_flips.get(moe_block, 0) > 0
    assert all(layer.passed for layer in report.layers if layer.block is not None and layer.block < moe_block)


@pytest.mark.parametrize(
    ("name", "dtype", "factor"), [("llama", "fp32", 1.01), ("custom", "fp32", 1.01), ("qwen3", "bf16", 1.05)]
)
def test_broken_norm_in_block_1_is_named(zoo, name, dtype, factor):
    src = _src(zoo, name)
    report = align(src, dtype=dtype, transform=scale_norm_output(1, factor), options=FAST)
    blocks = find_blocks(build_skeleton(src))
    norm_name, _ = first_norm(blocks.blocks[1])
    assert not report.passed
    assert report.first_divergent_block == 1
    assert report.first_divergent_component == norm_name
    assert report.first_divergent == f"{blocks.block_path(1)}.{norm_name}"
    # Block 0 is untouched and still agrees; the perturbed tensor's error is mostly adaptation, not dtype.
    assert all(layer.passed for layer in report.layers if layer.block == 0)
    broken = next(layer for layer in report.layers if layer.name == report.first_divergent)
    assert broken.err_ratio > 2


def test_nan_fails_at_once_and_names_the_module(zoo):
    src = _src(zoo, "llama")
    report = align(src, dtype="fp32", transform=poison_output(0, "mlp"), options=FAST)
    assert not report.passed
    assert report.nonfinite_module == "model.layers.0.mlp"
    assert report.first_divergent == "model.layers.0.mlp"
    assert report.layers == []  # stopped at the first non-finite output


def test_a_checkpoint_whose_loads_differ_is_inconclusive_not_a_dtype_cost(zoo, tmp_path):
    """Without lm_head.weight transformers initialises the head at random on each load, so the reference and the
    unadapted model compute different functions: no pass can come from comparing them."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(zoo("llama"), tmp_path / "headless")
    weights = load_file(tmp_path / "headless" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, tmp_path / "headless" / "model.safetensors")
    report = align(resolve_source(str(tmp_path / "headless")), dtype="fp32", options=FAST)
    assert not report.passed
    assert report.inconclusive and "does not reproduce its own reference at logits" in report.inconclusive


def test_inputs_are_fresh_unless_seeded(zoo):
    src = _src(zoo, "llama")
    options = AlignOptions(batch=1, seq_len=8, backward=False)
    first, second = align(src, dtype="fp32", options=options), align(src, dtype="fp32", options=options)
    assert first.seed != second.seed
    seeded = AlignOptions(batch=1, seq_len=8, backward=False, seed=7)
    a, b = align(src, dtype="bf16", options=seeded), align(src, dtype="bf16", options=seeded)
    assert [x.rel_err for x in a.layers] == [x.rel_err for x in b.layers]


def test_thresholds_are_configurable(zoo):
    src = _src(zoo, "llama")
    options = AlignOptions(batch=1, seq_len=8, backward=False, seed=3)
    slightly_off = scale_norm_output(0, 1.000005)  # 5e-6 relative: inside fp32's default floor of 1e-5
    assert align(src, dtype="fp32", transform=slightly_off, options=options).passed
    strict = align(src, dtype="fp32", transform=slightly_off, thresholds={"rel_err_floor": 1e-6}, options=options)
    assert not strict.passed and strict.first_divergent_block == 0
    assert strict.thresholds["rel_err_floor"] == 1e-6


def test_report_is_json_serialisable(zoo):
    import json

    report = align(_src(zoo, "gpt2"), dtype="bf16", options=FAST)
    data = json.loads(json.dumps(report.to_dict()))
    assert {"passed", "first_divergent", "layers"} <= set(data)
    assert {"name", "cosine", "rel_err", "max_abs", "err_ratio", "passed", "block", "component"} <= set(
        data["layers"][0]
    )


def test_moe_reference_runs_in_float64(zoo):
    """Grouped GEMM has no float64 kernel: the reference runs its experts through the per-expert loop instead."""
    report = align(_src(zoo, "qwen3_moe"), dtype="fp32", options=dataclasses.replace(FAST, parity_steps=0))
    assert report.reference_dtype == "float64"
    assert report.passed, report.notes


def test_a_reference_no_more_precise_than_the_candidate_is_not_a_pass(zoo):
    options = dataclasses.replace(FAST, parity_steps=0, reference_dtype="fp32")
    report = align(_src(zoo, "llama"), dtype="fp32", options=options)
    assert report.first_divergent is None and all(layer.passed for layer in report.layers)
    assert not report.passed
    assert report.inconclusive is not None and "float32" in report.inconclusive


def test_float64_reference_runs_a_model_that_builds_scalar_tensors_in_the_default_dtype(tmp_path):
    """XGLM floors its attention scores with ``torch.full((), finfo(float64).min)`` and no dtype: the float64
    reference must still run in float64 (torch's default dtype follows it), not fall back to float32."""
    import torch
    from transformers import XGLMConfig, XGLMForCausalLM

    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    config = XGLMConfig(vocab_size=128, d_model=32, ffn_dim=64, num_layers=2, attention_heads=4)
    XGLMForCausalLM(config).save_pretrained(tmp_path)
    report = align(resolve_source(str(tmp_path)), dtype="fp32", options=dataclasses.replace(FAST, parity_steps=0))
    assert report.reference_dtype == "float64"
    assert report.passed, report.notes
    assert torch.get_default_dtype() == torch.float32


class _NoisyOnOneToken(nn.Module):
    """Training-time noise on one token id only (a sampled choice that matters only where scores are close); the
    adapted twin draws one extra random number first, as a kernel that consumes the generator differently would."""

    def __init__(self, vocab: int, noisy_token: int, extra_draw: bool):
        super().__init__()
        self.lookup = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)
        self.noisy_token, self.extra_draw = noisy_token, extra_draw

    def forward(self, input_ids, **_):
        hidden = self.lookup(input_ids)
        if self.training:
            if self.extra_draw:
                torch.rand(1)
            noise = torch.randn_like(hidden) * (input_ids == self.noisy_token).unsqueeze(-1)
            hidden = hidden + noise
        return (self.head(hidden),)


def test_training_noise_that_only_later_batches_reach_is_turned_off_for_parity(rng):
    options, seed, vocab = AlignOptions(batch=1, seq_len=6, parity_steps=3), rng.randrange(10**6), 500
    batches = [batch_for_step(seed, step + 1, options.batch, options.seq_len, vocab, "cpu") for step in range(3)]
    later_only = sorted(set(batches[2].flatten().tolist()) - set(batches[0].flatten().tolist()))
    assert later_only  # six draws from 500 ids: the third batch holds an id the first lacks
    baseline = _NoisyOnOneToken(vocab, later_only[0], extra_draw=False)
    candidate = copy.deepcopy(baseline)
    candidate.extra_draw = True
    parity = _loss_parity(baseline, candidate, options, seed, vocab, "cpu", "fp32")
    assert parity.training_randomness_off and parity.passed, parity
