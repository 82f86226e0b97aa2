"""The parts a split half may lack, and the vocabulary projection without its loss: a normalised up half with no
residual (BERT's prediction-head transform), a down half that adds without normalising (a pre-norm layer's), and a
readout onto the vocabulary traced without the model's loss, each recognised by structure and float64 numbers with
its measured fields; look-alikes rejected; tiny BERT, Megatron-BERT and GIT models wholly recognised."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from ops_testlib import CPU, HandRMSNorm
from torch import nn

from operators import load_profile, plan_kernels
from operators.api import run_ops
from operators.inventory import trace_callable, trace_model
from operators.recognition import recognise

ACTS = [("gelu", nn.GELU()), ("relu", nn.ReLU()), ("gelu_tanh", nn.GELU("tanh")), ("tanh", nn.Tanh())]


@pytest.fixture(autouse=True)
def every_test_draws_fresh(fresh_seed):
    return fresh_seed


class Refine(nn.Module):
    """norm(act(proj(x))): ``level`` None normalises inline with its own gain and shift."""

    def __init__(self, width: int, level: nn.Module | None, squash: nn.Module, tiny: float):
        super().__init__()
        self.lift, self.squash, self.level, self.tiny = nn.Linear(width, width), squash, level, tiny
        if level is None:
            self.gain, self.shift = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))

    def forward(self, x):
        y = self.squash(self.lift(x))
        return (
            self.level(y) if self.level is not None else F.layer_norm(y, y.shape[-1:], self.gain, self.shift, self.tiny)
        )


class NormThenSquash(Refine):
    """act(norm(proj(x))): the same parts in another order, not this kind."""

    def forward(self, x):
        return self.squash(self.level(self.lift(x)))


class Merge(nn.Module):
    """dropout(proj(branch)) + carry, no norm: a pre-norm layer's output half."""

    def __init__(self, inner: int, width: int, p: float, carry_first: bool):
        super().__init__()
        self.lower, self.shake, self.carry_first = nn.Linear(inner, width), nn.Dropout(p), carry_first

    def combine(self, branch, carry):
        return carry + self.shake(self.lower(branch))

    def forward(self, a, b):
        return self.combine(b, a) if self.carry_first else self.combine(a, b)


class HalfCarry(Merge):
    """dropout(proj(branch)) + carry / 2: a look-alike whose add is not the plain residual sum."""

    def combine(self, branch, carry):
        return self.shake(self.lower(branch)) + carry / 2


def draws(rng: random.Random) -> dict:
    return {
        "width": rng.choice([16, 24, 32]),
        "inner": rng.choice([40, 48, 64]),
        "p": round(rng.uniform(0.05, 0.5), 3),
        "tiny": 10.0 ** -rng.randint(5, 12),
        "carry_first": rng.random() < 0.5,
    }


class Holder(nn.Module):
    """The part under test as a child (recognition starts below the model itself)."""

    def __init__(self, part: nn.Module):
        super().__init__()
        self.part = part

    def forward(self, *inputs):
        return self.part(*inputs)


def recognised(part: nn.Module, *inputs: torch.Tensor):
    """Components keyed by (path below the part, kind), and the rejections, paths below the part."""
    model = Holder(part).eval()
    recognition = recognise(model, trace_callable(model, *inputs))
    found = {(_below_part(c.module), c.kind): c for c in recognition.components}
    return found, [{**r, "module": _below_part(r["module"])} for r in recognition.rejected]


def _below_part(path: str) -> str:
    return path.removeprefix("part").removeprefix(".")


LEVELS = {
    "layer_norm": lambda d: nn.LayerNorm(d["width"], eps=d["tiny"]),
    "rms_norm": lambda d: HandRMSNorm(d["width"], d["tiny"]),
    "inline": lambda d: None,
}


@pytest.mark.parametrize("level", list(LEVELS))
def test_a_normalised_up_half_records_its_norm(level, rng):
    d = draws(rng)
    act_name, squash = rng.choice(ACTS)
    found, rejected = recognised(Refine(d["width"], LEVELS[level](d), squash, d["tiny"]), torch.randn(2, 7, d["width"]))
    assert not rejected
    head = found[("", "projection_activation")]
    v = head.variant
    assert head.confirmed and (v.activation, v.projection, v.width, v.inner) == (
        act_name,
        "lift",
        d["width"],
        d["width"],
    )
    expected = {
        "layer_norm": ("layer_norm", "level", "level.weight", "level.bias", None),
        "rms_norm": ("rms_norm", "level", "level.scale_vec", None, 0.0),
        "inline": ("layer_norm", None, "gain", "shift", None),
    }[level]
    assert (v.norm, v.norm_module, v.weight, v.bias, v.offset) == expected and v.eps == d["tiny"]
    assert len(found) == 1  # its norm and activation are parts of it


@pytest.mark.parametrize("level", ["layer_norm", "rms_norm"])
def test_the_norms_epsilon_is_told_from_a_smaller_one_on_the_module(level, rng):
    """Both epsilons are candidates; at unit scale they differ below the tolerance, on the tiny rows they do not."""
    d = {**draws(rng), "tiny": 10.0 ** -rng.uniform(5.0, 6.0)}
    part = Refine(d["width"], LEVELS[level](d), nn.GELU(), d["tiny"])
    part.spare = d["tiny"] / 100
    found, _ = recognised(part, torch.randn(2, 7, d["width"]))
    v = found[("", "projection_activation")].variant
    assert (v.norm, v.eps) == (level, d["tiny"])


def test_an_up_half_without_a_norm_records_none(rng):
    d = draws(rng)
    act_name, squash = rng.choice(ACTS)
    found, _ = recognised(nn.Sequential(nn.Linear(d["width"], d["inner"]), squash), torch.randn(2, 5, d["width"]))
    v = found[("", "projection_activation")].variant
    assert (v.activation, v.norm, v.norm_module, v.eps, v.weight) == (act_name, None, None, None, None)


def test_an_up_half_normalised_before_its_activation_is_rejected_and_its_parts_recognised(rng):
    d = draws(rng)
    model = NormThenSquash(d["width"], nn.LayerNorm(d["width"], eps=d["tiny"]), nn.GELU(), d["tiny"])
    found, rejected = recognised(model, torch.randn(2, 7, d["width"]))
    assert [(r["module"], r["candidate"]) for r in rejected] == [("", "projection_activation")]
    assert found[("level", "layer_norm")].variant.eps == d["tiny"] and ("squash", "activation") in found


def test_a_down_half_that_adds_without_a_norm_records_none_and_its_dropout(rng):
    d = draws(rng)
    model = Merge(d["inner"], d["width"], d["p"], d["carry_first"])
    branch, carry = torch.randn(2, 7, d["inner"]), torch.randn(2, 7, d["width"])
    found, rejected = recognised(model, *((carry, branch) if d["carry_first"] else (branch, carry)))
    assert not rejected
    half = found[("", "projection_residual_norm")]
    v = half.variant
    assert half.confirmed and (v.projection, v.width, v.inner, v.dropout) == ("lower", d["width"], d["inner"], d["p"])
    assert (v.branch_input, v.residual_input) == ((1, 0) if d["carry_first"] else (0, 1))
    assert (v.norm, v.norm_module, v.eps, v.weight, v.bias, v.offset) == (None,) * 6


def test_a_down_half_whose_add_scales_the_residual_is_rejected(rng):
    d = draws(rng)
    model = HalfCarry(d["inner"], d["width"], d["p"], False)
    found, rejected = recognised(model, torch.randn(2, 7, d["inner"]), torch.randn(2, 7, d["width"]))
    assert not any(kind == "projection_residual_norm" for _, kind in found)
    assert [(r["module"], r["candidate"]) for r in rejected] == [("", "projection_residual_norm")]


class Reader(nn.Module):
    """Token ids in, one output out, no loss: a lookup, a positional table looked up at the ids' shape, a readout."""

    def __init__(self, vocab: int, places: int, width: int, out: int, readout: nn.Module | None = None):
        super().__init__()
        self.lookup, self.places = nn.Embedding(vocab, width), nn.Embedding(places, width)
        self.mix = nn.Linear(width, width)
        self.readout = readout if readout is not None else nn.Linear(width, out, bias=False)

    def get_input_embeddings(self):
        return self.lookup

    def forward(self, input_ids, **_):
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return (self.readout(torch.tanh(self.mix(self.lookup(input_ids) + self.places(positions)))),)


class DoubledReadout(nn.Module):
    """2 * x @ W.T + b: a leaf projection onto the vocabulary that is not the plain one."""

    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.matrix, self.shift = nn.Parameter(torch.randn(vocab, width)), nn.Parameter(torch.randn(vocab))

    def forward(self, x):
        return 2 * x @ self.matrix.T + self.shift


def reader_recognition(model: Reader):
    recognition = recognise(model.eval(), trace_model(model, seq_len=6))
    heads = [c for c in recognition.components if c.kind in ("vocab_projection", "lm_head_cross_entropy")]
    return heads, recognition.rejected


def test_a_readout_onto_the_vocabulary_without_a_loss_is_the_vocab_projection(rng):
    vocab, width = rng.choice([40, 56, 72]), rng.choice([16, 24])
    model = Reader(vocab, rng.choice([30, 34]), width, vocab, nn.Linear(width, vocab, bias=rng.random() < 0.5))
    heads, rejected = reader_recognition(model)
    assert not rejected and [(c.module, c.kind, c.confirmed) for c in heads] == [("readout", "vocab_projection", True)]
    v = heads[0].variant
    assert (v.vocab, v.hidden, v.weight, v.bias) == (
        vocab,
        width,
        "weight",
        "bias" if model.readout.bias is not None else None,
    )


def test_a_readout_onto_a_positional_tables_width_is_no_vocab_projection(rng):
    places, width = rng.choice([30, 34]), rng.choice([16, 24])
    heads, _ = reader_recognition(Reader(rng.choice([40, 56]), places, width, places))
    assert heads == []


def test_a_vocabulary_readout_that_is_not_plain_is_rejected(rng):
    vocab, width = rng.choice([40, 56]), rng.choice([16, 24])
    heads, rejected = reader_recognition(Reader(vocab, 30, width, vocab, DoubledReadout(width, vocab)))
    assert heads == [] and [(r["module"], r["candidate"]) for r in rejected] == [("readout", "vocab_projection")]


def every_flop_recognised(report) -> bool:
    return sum(o.recognised_flops for o in report.plan.ops) == sum(o.flops for o in report.plan.ops) > 0


def share_without(report, left_out) -> float:
    kept = [c for c in report.recognition.components if not left_out(c)]
    return plan_kernels(report.inventory, kept, load_profile("cuda-hopper"), CPU).coverage()["flops_share_recognised"]


def tiny_checkpoint(tmp_path, model_type: str, rng: random.Random, **extra) -> tuple:
    from transformers import AutoConfig, AutoModelForCausalLM

    eps, p = 10.0 ** -rng.randint(5, 12), round(rng.uniform(0.05, 0.3), 3)
    config = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=rng.choice([48, 64]), max_position_embeddings=64,
                                  layer_norm_eps=eps, hidden_dropout_prob=p, **extra)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return run_ops(tmp_path, target=CPU, onnx=False), eps, p


def test_a_tiny_bert_prediction_head_transform_is_recognised(tmp_path, rng):
    report, eps, _ = tiny_checkpoint(tmp_path, "bert", rng, is_decoder=True)
    assert report.patch_check.passed and every_flop_recognised(report)
    (transform,) = [c for c in report.recognition.components if c.module == "cls.predictions.transform"]
    v = transform.variant
    assert transform.kind == "projection_activation" and transform.confirmed
    assert (v.activation, v.norm, v.eps, v.norm_module, v.width, v.inner) == (
        "gelu",
        "layer_norm",
        eps,
        "LayerNorm",
        32,
        32,
    )
    assert report.plan.coverage()["flops_share_recognised"] > share_without(report, lambda c: c.variant is v)


def test_a_tiny_megatron_bert_output_halves_add_without_a_norm(tmp_path, rng):
    report, _, p = tiny_checkpoint(tmp_path, "megatron-bert", rng, is_decoder=True)
    assert report.patch_check.passed and every_flop_recognised(report)
    halves = {c.module: c for c in report.recognition.components if c.kind == "projection_residual_norm"}
    assert sorted(halves) == sorted(
        f"bert.encoder.layer.{i}.{h}" for i in range(2) for h in ("attention.output", "output")
    )
    for half in halves.values():
        v = half.variant
        assert half.confirmed and (v.norm, v.norm_module, v.dropout, v.branch_input, v.residual_input) == (
            None,
            None,
            p,
            0,
            1,
        )
    unnormalised = share_without(report, lambda c: c.kind == "projection_residual_norm")
    assert report.plan.coverage()["flops_share_recognised"] > unnormalised


def test_a_tiny_git_traced_without_its_loss_has_its_vocab_projection(tmp_path, rng):
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
              "image_size": 32, "patch_size": 16}  # fmt: skip
    report, _, _ = tiny_checkpoint(tmp_path, "git", rng, vision_config=vision)
    assert report.patch_check.passed and every_flop_recognised(report)
    assert not report.recognition.by_kind("lm_head_cross_entropy")
    (head,) = report.recognition.by_kind("vocab_projection")
    assert (head.module, head.confirmed, head.variant.vocab, head.variant.hidden) == ("output", True, 96, 32)
    assert report.plan.component("output", "vocab_projection").status == "native"
    assert report.plan.coverage()["flops_share_recognised"] > share_without(report, lambda c: c is head)
