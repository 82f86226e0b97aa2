"""An MLP (or attention output) split across sibling modules, BERT's way: each half recognised by its structure and
float64 numbers, with its measured variant; look-alikes rejected; a tiny BERT's blocks wholly recognised."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from ops_testlib import CPU, HandRMSNorm
from torch import nn

from operators import load_profile, plan_kernels
from operators.api import check_kernel_plan, run_ops
from operators.inventory import trace_callable, trace_model
from operators.recognition import recognise
from operators.registry import Target

SPLIT_KINDS = ("projection_activation", "projection_residual_norm")


@pytest.fixture(autouse=True)
def every_test_draws_fresh(fresh_seed):
    return fresh_seed


class Widen(nn.Module):
    """act(proj(x)): the up half."""

    def __init__(self, width: int, inner: int, squash):
        super().__init__()
        self.lift = nn.Linear(width, inner)
        self.squash = squash

    def forward(self, x):
        return self.squash(self.lift(x))


class Settle(nn.Module):
    """norm(dropout(proj(branch)) + carry): the down half; ``level`` None normalises inline with its own gain/shift."""

    def __init__(self, inner: int, width: int, level: nn.Module | None, p: float, tiny: float, carry_first: bool):
        super().__init__()
        self.lower = nn.Linear(inner, width)
        self.shake = nn.Dropout(p)
        self.level = level
        self.tiny, self.carry_first = tiny, carry_first
        if level is None:
            self.gain, self.shift = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))

    def combine(self, branch, carry):
        total = self.shake(self.lower(branch)) + carry
        return (
            self.level(total)
            if self.level is not None
            else F.layer_norm(total, total.shape[-1:], self.gain, self.shift, self.tiny)
        )

    def forward(self, a, b):
        return self.combine(b, a) if self.carry_first else self.combine(a, b)


class NormBeforeAdd(Settle):
    """norm(proj(branch)) + carry: a post-norm look-alike, not this kind."""

    def combine(self, branch, carry):
        return self.level(self.lower(branch)) + carry


class ResidualDropped(Settle):
    """norm(proj(branch) + dropout(carry)): the eval function matches; training mode drops the residual instead."""

    def combine(self, branch, carry):
        return self.level(self.lower(branch) + self.shake(carry))


class Stratum(nn.Module):
    def __init__(self, width: int, inner: int, settle: Settle, squash):
        super().__init__()
        self.widen, self.settle = Widen(width, inner, squash), settle

    def forward(self, h):
        up = self.widen(h)
        return self.settle(h, up) if self.settle.carry_first else self.settle(up, h)


class Toy(nn.Module):
    """Token ids in, logits out: a lookup, split-MLP strata, a readout."""

    def __init__(self, vocab: int, width: int, strata: list[Stratum]):
        super().__init__()
        self.lookup = nn.Embedding(vocab, width)
        self.strata = nn.ModuleList(strata)
        self.readout = nn.Linear(width, vocab)

    def get_input_embeddings(self):
        return self.lookup

    def forward(self, input_ids, **_):
        h = self.lookup(input_ids)
        for stratum in self.strata:
            h = stratum(h)
        return (self.readout(h),)


def draws(rng: random.Random) -> dict:
    return {
        "width": rng.choice([16, 24, 32]),
        "inner": rng.choice([40, 48, 64]),
        "p": round(rng.uniform(0.05, 0.5), 3),
        "tiny": 10.0 ** -rng.randint(5, 12),
        "carry_first": rng.random() < 0.5,
    }


def recognised_stratum(settle_class, level, squash, d: dict):
    width = d["width"]
    settle = settle_class(d["inner"], width, level, d["p"], d["tiny"], d["carry_first"])
    model = Stratum(width, d["inner"], settle, squash).eval()
    inventory = trace_callable(model, torch.randn(2, 7, width))
    recognition = recognise(model, inventory)
    return {(c.module, c.kind): c for c in recognition.components}, recognition.rejected


LEVELS = {
    "layer_norm": lambda d: nn.LayerNorm(d["width"], eps=d["tiny"]),
    "layer_norm_plain": lambda d: nn.LayerNorm(d["width"], eps=d["tiny"], elementwise_affine=False),
    "rms_norm": lambda d: HandRMSNorm(d["width"], d["tiny"]),
    "inline": lambda d: None,
}


@pytest.mark.parametrize("level", list(LEVELS))
def test_both_halves_are_recognised_with_their_measured_variants(level, rng):
    d = draws(rng)
    act_name, squash = rng.choice([("gelu", nn.GELU()), ("relu", nn.ReLU()), ("gelu_tanh", nn.GELU("tanh"))])
    found, rejected = recognised_stratum(Settle, LEVELS[level](d), squash, d)
    assert not rejected
    up = found[("widen", "projection_activation")].variant
    assert (up.activation, up.projection, up.width, up.inner) == (act_name, "lift", d["width"], d["inner"])
    down = found[("settle", "projection_residual_norm")]
    v = down.variant
    assert down.confirmed and (v.projection, v.width, v.inner) == ("lower", d["width"], d["inner"])
    assert (v.branch_input, v.residual_input) == ((1, 0) if d["carry_first"] else (0, 1))
    assert v.eps == d["tiny"] and v.dropout == d["p"]
    expected = {
        "layer_norm": ("layer_norm", "level", "level.weight", "level.bias", None),
        "layer_norm_plain": ("layer_norm", "level", None, None, None),
        "rms_norm": ("rms_norm", "level", "level.scale_vec", None, 0.0),
        "inline": ("layer_norm", None, "gain", "shift", None),
    }[level]
    assert (v.norm, v.norm_module, v.weight, v.bias, v.offset) == expected
    if level != "inline":  # the norm stays its own component, fed by the add this half runs
        assert found[("settle.level", "residual_add_norm")].variant.add_in == "settle"
    assert ("widen.squash", "activation") not in found  # the up half holds its activation


def test_a_dropout_off_the_branch_confirms_only_the_eval_function(rng):
    d = draws(rng)
    found, _ = recognised_stratum(ResidualDropped, nn.LayerNorm(d["width"], eps=d["tiny"]), nn.GELU(), d)
    v = found[("settle", "projection_residual_norm")].variant
    assert v.norm == "layer_norm" and v.dropout is None


def test_lookalikes_are_rejected_and_their_parts_recognised_as_before(rng):
    d = draws(rng)
    found, rejected = recognised_stratum(NormBeforeAdd, nn.LayerNorm(d["width"], eps=d["tiny"]), nn.ELU(), d)
    assert not [key for key in found if key[1] in SPLIT_KINDS]
    assert sorted((r["module"], r["candidate"]) for r in rejected) == [
        ("settle", "projection_residual_norm"),
        ("widen", "projection_activation"),
    ]
    assert ("settle.level", "layer_norm") in found and ("widen.squash", "activation") in found  # ELU: no reference


@pytest.mark.parametrize("training", [True, False])
def test_an_rms_down_half_keeps_the_fused_add_norm_and_the_patched_model_matches(rng, training):
    """The down half runs as traced; its RMSNorm child still fuses with the add (Triton interpreter on CPU)."""
    d = {**draws(rng), "p": 0.0}
    strata = [
        Stratum(
            d["width"],
            d["inner"],
            Settle(d["inner"], d["width"], HandRMSNorm(d["width"], d["tiny"]), 0.0, d["tiny"], d["carry_first"]),
            nn.SiLU(),
        )
        for _ in range(2)
    ]
    model = Toy(64, d["width"], strata).eval()
    inventory = trace_model(model, seq_len=6)
    plan = plan_kernels(
        inventory, recognise(model, inventory), load_profile("cuda-hopper"), Target("cpu", "float32", training, None)
    )
    halves = [c for c in plan.components if c.kind in SPLIT_KINDS]
    assert sorted(c.module for c in halves) == sorted(f"strata.{i}.{h}" for i in range(2) for h in ("widen", "settle"))
    assert all((c.status, c.confirmed, c.patch) == ("native", True, False) for c in halves)
    fused = [c for c in plan.components if c.kind == "residual_add_norm"]
    assert [(c.module, c.kernel, c.status) for c in fused] == [
        (f"strata.{i}.settle.level", "add_rms_norm", "fused") for i in range(2)
    ]
    check = check_kernel_plan(model, plan)
    assert check.passed and check.residual_fusion["fused"] == 2


def test_a_tiny_bert_has_every_block_flop_recognised_and_still_patches_cleanly(tmp_path, rng):
    from transformers import BertConfig, BertModel

    eps, p = 10.0 ** -rng.randint(5, 12), round(rng.uniform(0.05, 0.3), 3)
    config = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=rng.choice([48, 64]),
                        max_position_embeddings=64, layer_norm_eps=eps, hidden_dropout_prob=p)  # fmt: skip
    BertModel(config).save_pretrained(tmp_path)
    report = run_ops(tmp_path, target=CPU, onnx=False)
    assert report.patch_check.passed
    halves = {c.module: c for c in report.recognition.components if c.kind in SPLIT_KINDS}
    for i in range(2):
        up = halves[f"encoder.layer.{i}.intermediate"].variant
        assert up.activation == "gelu" and (up.width, up.inner) == (32, config.intermediate_size)
        for name in ("attention.output", "output"):
            v = halves[f"encoder.layer.{i}.{name}"].variant
            assert (v.norm, v.eps, v.dropout, v.branch_input, v.residual_input) == ("layer_norm", eps, p, 0, 1)
    recognised = sum(o.recognised_flops for o in report.plan.ops)
    in_blocks = sum(o.flops for o in report.inventory.ops if o.module.startswith("encoder.layer."))
    assert in_blocks > 0 and recognised >= in_blocks
    without = [c for c in report.recognition.components if c.kind not in SPLIT_KINDS]
    before = plan_kernels(report.inventory, without, load_profile("cuda-hopper"), CPU)
    assert report.plan.coverage()["flops_share_recognised"] > before.coverage()["flops_share_recognised"]
