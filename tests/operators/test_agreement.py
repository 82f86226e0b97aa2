"""Intake's spec against the operators' recognition: the zoo agrees, a real difference is one typed disagreement."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from ops_testlib import recognised
from torch import nn

from adapt.model.intake import build_spec, describe_model, inspect, resolve_source
from operators import run_ops
from operators.agreement import BEYOND_PROBE, NOT_TRACED, Disagreement, compare_with_spec
from operators.inventory import trace_model
from operators.recognition import Recognition, recognise
from operators.recognition.variants import AttentionVariant


def _agreement(path):
    spec = inspect(str(path), trust_remote_code=True)
    return spec, recognised(str(path))[2]


def test_every_zoo_family_agrees_block_by_block(zoo_model):
    name, path = zoo_model
    spec, recognition = _agreement(path)
    agreement = compare_with_spec(spec, recognition)
    assert agreement.disagreements == [], name
    layers = spec.num_layers
    # every block's mixer, attention, MLP and norms were stated by both sides, not left open
    for fact in ("mixer", "attention.layout", "attention.causal", "rope", "mlp.kind", "mlp.activation", "norm.kind"):
        assert agreement.compared.get(fact, 0) >= layers, (name, fact)
    assert agreement.compared.get("norm.eps", 0) >= layers
    assert {n.field for n in agreement.not_examined if n.side == "operators"} <= {"head.tied", "head.softcap"}
    heads = [c for c in recognition.components if c.kind in ("lm_head_cross_entropy", "vocab_projection")]
    # a head and its token table traced: tying compared, else left open because no head was there to compare
    assert agreement.compared.get("head.tied") == (1 if heads else None), name
    if spec.is_moe:
        assert agreement.compared["moe.top_k"] == sum(b.mlp.kind == "moe" for b in spec.blocks)


# ---- a model written for the test: its window is under a name no convention reads ------------------------------

WIDTH, HEADS, SPAN, REACH, VOCAB = 32, 4, 8, 5, 61


class Gaze(nn.Module):
    """Causal attention that sees only the last ``reach`` positions: the window no config or attribute names."""

    def __init__(self):
        super().__init__()
        self.reach = REACH
        self.ask, self.key, self.val = (nn.Linear(WIDTH, HEADS * SPAN, bias=False) for _ in range(3))
        self.tell = nn.Linear(HEADS * SPAN, WIDTH, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (proj(h).view(b, t, HEADS, SPAN).transpose(1, 2) for proj in (self.ask, self.key, self.val))
        pos = torch.arange(t, device=h.device)
        seen = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < self.reach)
        scores = (q @ k.transpose(-1, -2) / SPAN**0.5).masked_fill(~seen, float("-inf"))
        return self.tell((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, HEADS * SPAN))


class Level(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(WIDTH))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.gain * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class Forge(nn.Module):
    def __init__(self):
        super().__init__()
        self.lift, self.valve = nn.Linear(WIDTH, 64, bias=False), nn.Linear(WIDTH, 64, bias=False)
        self.drop = nn.Linear(64, WIDTH, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(F.silu(self.valve(h)) * self.lift(h))


class Course(nn.Module):
    def __init__(self):
        super().__init__()
        self.before, self.gaze, self.between, self.forge = Level(), Gaze(), Level(), Forge()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.gaze(self.before(h))
        return h + self.forge(self.between(h))


class Wall(nn.Module):
    def __init__(self, depth: int = 2):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB, model_type="wall")
        self.bricks = nn.Embedding(VOCAB, WIDTH)
        self.courses = nn.ModuleList([Course() for _ in range(depth)])
        self.cap = Level()
        self.face = nn.Linear(WIDTH, VOCAB, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.bricks

    def get_output_embeddings(self) -> nn.Linear:
        return self.face

    def can_generate(self) -> bool:
        return True

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        h = self.bricks(input_ids)
        for course in self.courses:
            h = course(h)
        return (self.face(self.cap(h)),)


def test_a_window_only_the_numbers_show_is_the_one_disagreement():
    torch.manual_seed(0)
    model = Wall().eval()
    spec = describe_model(model, model.config)
    inventory = trace_model(model)
    assert inventory.input_shape[-1] > REACH  # the probe's sequence is longer than the window, so it shows
    agreement = compare_with_spec(spec, recognise(model, inventory))
    assert agreement.disagreements == [
        Disagreement("mixer", "full_attention", "sliding_attention", f"courses.{i}.gaze") for i in range(2)
    ]
    assert agreement.compared["norm.kind"] == 4 and agreement.compared["mlp.activation"] == 2


def _head_tied(recognition: Recognition) -> bool | None:
    (head,) = [c for c in recognition.components if c.kind in ("lm_head_cross_entropy", "vocab_projection")]
    return head.variant.tied


@pytest.mark.parametrize("tying", ["separate", "one parameter", "one storage", "equal copy"])
def test_the_operators_see_a_head_tied_when_it_shares_the_token_tables_storage(tying):
    torch.manual_seed(0)
    model = Wall(depth=1).eval()
    if tying == "one parameter":
        model.face.weight = model.bricks.weight
    elif tying == "one storage":  # two Parameter objects over one tensor: still one matrix
        model.face.weight = nn.Parameter(model.bricks.weight.data)
    elif tying == "equal copy":  # equal values, two storages: training moves them apart
        model.face.weight = nn.Parameter(model.bricks.weight.detach().clone())
    tied = tying in ("one parameter", "one storage")
    recognition = recognise(model, trace_model(model))
    assert _head_tied(recognition) is tied
    spec = describe_model(model, model.config)
    agreement = compare_with_spec(spec, recognition)
    assert agreement.compared["head.tied"] == 1 and spec.head.tied is tied
    assert not any(d.field == "head.tied" for d in agreement.disagreements)
    flipped = dataclasses.replace(spec, head=dataclasses.replace(spec.head, tied=not tied))
    assert [d for d in compare_with_spec(flipped, recognition).disagreements if d.field == "head.tied"] == [
        Disagreement("head.tied", not tied, tied, "face")
    ]


# ---- what one side did not examine is never a disagreement ---------------------------------------------------------


def _with_attention(recognition: Recognition, **fields) -> Recognition:
    components = [
        dataclasses.replace(c, variant=dataclasses.replace(c.variant, **fields))
        if isinstance(c.variant, AttentionVariant)
        else c
        for c in recognition.components
    ]
    return Recognition(components, recognition.rejected)


def test_a_window_longer_than_the_probe_is_not_examined_and_a_missing_attention_disagrees(zoo):
    spec, recognition = _agreement(zoo("mistral"))
    window = spec.blocks[0].attention.window
    short = _with_attention(recognition, seq_len=window - 1, window=None)  # the probe could not see the window
    agreement = compare_with_spec(spec, short)
    assert agreement.disagreements == []
    (left,) = [n for n in agreement.not_examined if n.field == "attention.window"]
    assert (left.side, left.reason, len(left.modules)) == ("operators", BEYOND_PROBE, spec.num_layers)

    first = spec.blocks[0].module
    without = Recognition([c for c in recognition.components if c.module != f"{first}.self_attn"], [])
    assert compare_with_spec(spec, without).disagreements == [
        Disagreement("mixer", spec.blocks[0].mixer, "no attention", first)
    ]
    untraced = compare_with_spec(spec, without, traced=[b.module for b in spec.blocks[1:]])
    assert untraced.disagreements == []
    assert [(n.field, n.reason, n.modules) for n in untraced.not_examined if n.field == "block"] == [
        ("block", NOT_TRACED, (first,))
    ]


def test_attention_whose_query_heads_are_experts_is_attention_to_both_sides(tmp_path):
    """JetMoE keeps each token's query heads as routed experts beside one key/value projection."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "jetmoe", vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        kv_channels=16, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # a router left at zero ties every choice; a trained one does not
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(0.0, 0.02)
    model.save_pretrained(tmp_path)
    spec = inspect(str(tmp_path))
    attention = spec.blocks[0].attention
    assert [b.mixer for b in spec.blocks] == ["full_attention"] * 2 and spec.novelties == []
    assert (attention.kind, attention.num_heads, attention.num_kv_heads, attention.head_dim) == ("gqa", 4, 2, 16)
    assert spec.blocks[0].positional == "rope" and spec.blocks[0].mlp.kind == "moe"
    agreement = compare_with_spec(spec, recognised(str(tmp_path))[2])
    assert agreement.disagreements == [] and agreement.compared["attention.layout"] == 2


@pytest.mark.parametrize("mixer", ["recurrent", "convolution", "unknown"])
def test_a_mixer_no_operators_kind_covers_agrees_with_no_attention(zoo, mixer):
    spec, recognition = _agreement(zoo("llama"))
    block = spec.blocks[0]
    spec.blocks[0] = dataclasses.replace(block, mixer=mixer, attention=None)
    without = Recognition([c for c in recognition.components if c.module != f"{block.module}.self_attn"], [])
    agreement = compare_with_spec(spec, without)
    assert agreement.disagreements == [] and agreement.compared["mixer"] == spec.num_layers


def test_the_blocks_feed_forward_is_its_outermost_mlp_not_one_inside_a_norm(tmp_path):
    """AXK2's input norm is gated by a small plain MLP of its own: the block's MLP is the gated one beside it."""
    import importlib.util

    from transformers import CONFIG_MAPPING

    if "axk2" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no axk2")
    path = Path(__file__).parents[2] / "benchmarks" / "sweep_tiny.py"
    loader = importlib.util.spec_from_file_location("bench_sweep_tiny_agreement", path)
    sweep_tiny = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(sweep_tiny)
    sweep_tiny.build("axk2", tmp_path / "axk2")  # the type's default config, shrunk
    source = resolve_source(str(tmp_path / "axk2"))
    spec = build_spec(source)
    agreement = run_ops(source, onnx=False, check_patch=False, spec=spec).agreement.to_dict()
    assert agreement["compared"]["mlp.kind"] == len(spec.blocks)
    assert [d for d in agreement["disagreements"] if d["field"].startswith("mlp.")] == []
