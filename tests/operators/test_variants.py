"""The typed variants: every kind round-trips through its JSON object, and files written before them still load."""

from __future__ import annotations

import dataclasses
import json
import random
import string
import types
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

from adapt.core.errors import BadInput
from operators.mapping import KernelChoice, KernelPlan
from operators.ops_report import OpsReport
from operators.providers import torch_native, triton_moe
from operators.recognition.component import Component
from operators.recognition.variants import (
    VARIANTS,
    GatedMLPVariant,
    MoEVariant,
    NewVariant,
    RMSNormVariant,
    UnknownVariant,
    variant_from_dict,
)
from operators.registry import Target

REPORTS = Path(__file__).parents[1] / "reports" / "data"


def fresh(tp: typing.Any, rng: random.Random) -> typing.Any:
    """A random value of the field type ``tp`` (None now and then where the field allows it)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        present = [a for a in args if a is not type(None)]
        return None if rng.random() < 0.2 else fresh(present[0], rng)
    if typing.get_origin(tp) is tuple:
        return tuple(fresh(args[0], rng) for _ in range(rng.randrange(4)))
    if dataclasses.is_dataclass(tp):
        return fresh_record(tp, rng)
    if tp is bool:
        return rng.random() < 0.5
    if tp is int:
        return rng.randrange(-(1 << 20), 1 << 20)
    if tp is float:
        return rng.uniform(-1e3, 1e3)
    if tp is str:
        return "".join(rng.choices(string.ascii_lowercase + "._", k=rng.randrange(1, 12)))
    raise AssertionError(f"no generator for {tp}")


def fresh_record(cls: type, rng: random.Random) -> typing.Any:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: fresh(hints[f.name], rng) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_each_kind_round_trips_through_json(kind, fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(5):
        variant = fresh_record(VARIANTS[kind], rng)
        data = json.loads(json.dumps(variant.to_dict()))
        assert variant_from_dict(kind, data) == variant
        component = Component(fresh(str, rng), kind, variant, rng.random() < 0.5, fresh(str, rng))
        assert Component.from_dict(json.loads(json.dumps(component.to_dict()))) == component
        choice = KernelChoice(component.module, kind, variant, "p", "k", "fused", component.confirmed, margin=1.5)
        assert KernelChoice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice


def test_the_json_keys_are_the_ones_ops_json_always_had():
    rotation = variant_from_dict("rotary_application", {"global": "apply_rotary_pos_emb", "style": "half"})
    assert rotation.global_name == "apply_rotary_pos_emb"
    assert set(rotation.to_dict()) == {
        "function", "global", "calls_per_forward", "style", "rotary_dim", "head_dim", "table", "layout"
    }  # fmt: skip
    # an ops.json written before the complex-table form was known reads as what it described: cos/sin on bhsd heads
    assert (rotation.table, rotation.layout) == ("cos_sin", "bhsd")
    attention = variant_from_dict(
        "attention", {"rope": {"style": "half", "rotary_dim": 8}, "latent_projections": ["a"]}
    )
    assert attention.rope.rotary_dim == 8 and attention.latent_projections == ("a",)
    assert attention.to_dict()["rope"] == {"style": "half", "rotary_dim": 8, "partial": False, "decoupled": False}


def test_a_key_this_version_does_not_know_is_refused_by_name(fresh_seed):
    rng = random.Random(fresh_seed)
    data = fresh_record(RMSNormVariant, rng).to_dict()
    with pytest.raises(BadInput, match="model.norm.*round_first"):
        Component.from_dict({"module": "model.norm", "kind": "rms_norm", "variant": {**data, "round_first": True}})
    with pytest.raises(BadInput, match=r"attention variant\.rope: .* turns"):
        variant_from_dict("attention", {"rope": {"style": "half", "turns": 2}})


def test_a_kind_this_version_does_not_know_keeps_its_fields(fresh_seed):
    raw = {"state_size": fresh_seed % 97, "chunk": [1, 2], "scan": "parallel"}
    choice = KernelChoice.from_dict(
        {"module": "m", "kind": "selective_scan", "variant": raw, "provider": None, "kernel": None}
        | {"status": "native", "confirmed": False}
    )
    assert isinstance(choice.variant, UnknownVariant) and choice.to_dict()["variant"] == raw
    assert choice.variant.raw == raw


def test_a_component_needs_its_kinds_variant():
    with pytest.raises(TypeError, match="RMSNormVariant"):
        Component("model.norm", "rms_norm", {"eps": 1e-6})
    with pytest.raises(TypeError, match="MoEVariant"):
        KernelChoice("m", "moe", GatedMLPVariant(), None, None, "native", False)


@pytest.mark.parametrize("name", ["qwen3_moe", "tiny-llama", "custom"])
def test_an_operators_result_written_before_the_typed_variants_loads(name):
    """Stored ``adapt run`` results from an earlier version: every variant typed, every stored value kept."""
    stored = json.loads((REPORTS / f"{name}.report.json").read_text())
    result = next(s["result"] for s in stored["stages"] if s["name"] == "operators")
    report = OpsReport.from_dict(result)
    again = report.to_dict()
    for before, after, choice in zip(result["components"], again["components"], report.plan.components):
        assert type(choice.variant) is VARIANTS[choice.kind]
        assert {k: after["variant"][k] for k in before["variant"]} == before["variant"]
    assert KernelPlan.from_dict(report.plan.to_dict()) == report.plan
    for moe in (c for c in report.plan.components if c.kind == "moe"):  # recognised before expert lists existed
        assert moe.variant.expert_container is None and triton_moe.unsupported_reason(moe.variant) is None


def test_an_older_kernel_choice_still_patches(fresh_seed):
    """A choice as ops.json held it (no field added since, in the key order of the time) drives its kernel."""
    width = 8 + fresh_seed % 24
    eps = 10.0 ** -(4 + fresh_seed % 3)
    older = {
        "module": "norm",
        "kind": "rms_norm",
        "provider": "torch-native",
        "kernel": "F.rms_norm",
        "status": "fused",
        "confirmed": True,
        "variant": {"eps": eps, "offset": 1.0, "weight": "gain", "cast": "scale_then_round", "width": width},
        "patch": True,
    }
    choice = KernelChoice.from_dict(older)
    assert choice.variant == RMSNormVariant(eps=eps, offset=1.0, weight="gain", cast="scale_then_round", width=width)
    component = Component(choice.module, choice.kind, choice.variant, choice.confirmed)
    (option,) = torch_native.TorchNativeProvider().options(component, Target("cpu", "float32", True, None))
    module = nn.Module()
    module.gain = nn.Parameter(torch.randn(width))
    x = torch.randn(3, width, dtype=torch.bfloat16)
    got = option.make_forward(module, component)(x)
    x32 = x.float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + module.gain)).to(torch.bfloat16)
    torch.testing.assert_close(got, want)
    new = KernelChoice.from_dict({**older, "kind": "new", "variant": {"ops": ["aten.asinh.default"]}})
    assert new.variant == NewVariant(ops=("aten.asinh.default",), container=False)
    assert MoEVariant.from_dict({"top_k": 2}).n_group == 1  # the defaults the readers' .get() fell back to
