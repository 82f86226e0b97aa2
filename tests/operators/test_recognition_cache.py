"""Probe caching: identical modules are probed once, different ones (eps, width, mask) again, look-alikes still fail."""

from __future__ import annotations

import pytest
import torch
from ops_testlib import load
from torch import nn

from operators import recognition
from operators.inventory import trace_callable, trace_model
from operators.recognition import attention as attention_recognition
from operators.recognition import classifiers
from operators.timing_cache import DiskCache


class Rms(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, h):
        return self.gain * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)


class EpsOutside(Rms):
    """Same parameters and attributes as ``Rms``; eps added outside the square root."""

    def forward(self, h):
        return self.gain * h / (torch.sqrt(h.pow(2).mean(-1, keepdim=True)) + self.eps)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.n0, self.n1, self.eps_5 = Rms(32, 1e-6), Rms(32, 1e-6), Rms(32, 1e-5)
        self.widen = nn.Linear(32, 48)
        self.wide, self.fake0, self.fake1 = Rms(48, 1e-6), EpsOutside(48, 1e-6), EpsOutside(48, 1e-6)

    def forward(self, x):
        x = self.eps_5(self.n1(self.n0(self.inp(x))))
        return self.fake1(self.fake0(self.wide(self.widen(x))))


def counting(monkeypatch, module, name: str) -> list[str]:
    """Wrap the probe ``name`` where ``module`` calls it, so every real probe run is recorded."""
    calls: list[str] = []
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_identical_norms_probed_once_different_eps_width_and_lookalikes_probed_again(monkeypatch):
    calls = counting(monkeypatch, classifiers, "probe_norm")
    model = Tower()
    cache = recognition.ProbeCache()
    found = recognition.recognise(model, trace_callable(model, torch.randn(2, 7, 32)), cache=cache)
    comps = {c.module: c for c in found.components if c.kind == "rms_norm"}
    # n0 probed; n1 reuses it; eps 1e-5, width 48 and the look-alike class are each probed; fake1 reuses fake0's rejection.
    assert len(calls) == cache.probes_run == 4
    assert set(comps) == {"n0", "n1", "eps_5", "wide"}
    probed_on = {a.module: a.probed_on for a in cache.answers}
    assert probed_on == {"n0": "n0", "n1": "n0", "eps_5": "eps_5", "wide": "wide", "fake0": "fake0", "fake1": "fake0"}
    assert (comps["n0"].variant.eps, comps["eps_5"].variant.eps) == (1e-6, 1e-5)
    assert comps["wide"].variant.width == 48
    assert sorted(r["module"] for r in found.rejected) == ["fake0", "fake1"]


@pytest.mark.parametrize(("name", "probes", "windows"), [("llama", 1, {None}), ("gemma2", 2, {16, None})])
def test_attention_probed_once_per_structure_and_mask(zoo, monkeypatch, name, probes, windows):
    """All llama layers share one visibility probe; Gemma-2's sliding and global layers see different masks."""
    calls = counting(monkeypatch, attention_recognition, "attention_visibility")
    model = load(zoo(name))
    cache = recognition.ProbeCache()
    found = recognition.recognise(model, trace_model(model), cache=cache)
    attention = [c for c in found.components if c.kind == "attention"]
    assert len(attention) >= 2 and all(c.confirmed for c in attention)
    assert len(calls) == probes
    assert {c.variant.window for c in attention} == windows
    reused = {a.module for a in cache.answers if a.probed_on != a.module}
    assert sum(c.module in reused for c in attention) == len(attention) - probes


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_identical_moe_blocks_probed_once_each_keeping_its_own_paths(zoo, monkeypatch, name):
    """The MoE probe is the costliest; the verdict's router and expert paths move to each block that reuses it."""
    calls = counting(monkeypatch, classifiers, "probe_moe")
    model = load(zoo(name))
    cache = recognition.ProbeCache()
    found = recognition.recognise(model, trace_model(model), cache=cache)
    moes = [c for c in found.components if c.kind == "moe"]
    assert len(moes) >= 2 and all(c.confirmed for c in moes) and len(calls) == 1
    reused = {a.module for a in cache.answers if a.probed_on != a.module}
    assert sum(c.module in reused for c in moes) == len(moes) - 1
    for c in moes:
        assert c.variant.router.startswith(c.module + ".")
        paths = [v for v in c.variant.to_dict().values() if isinstance(v, str) and v.startswith("model.")]
        assert paths and all(p.startswith(c.module + ".") for p in paths)


def _variants(found) -> list[tuple]:
    return sorted((c.module, c.kind, c.confirmed, c.variant) for c in found.components)


def _disk_run(model: nn.Module) -> tuple[recognition.Recognition, recognition.ProbeCache]:
    cache = recognition.ProbeCache(DiskCache("probe_verdicts"))
    return recognition.recognise(model, trace_callable(model, torch.randn(2, 7, 32)), cache=cache), cache


def test_verdicts_kept_on_disk_are_reused_by_a_later_run_without_probing(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    first, first_cache = _disk_run(Tower())
    calls = counting(monkeypatch, classifiers, "probe_norm")
    second, second_cache = _disk_run(Tower())
    assert (first_cache.probes_run, first_cache.reused_from_disk) == (4, 0)
    assert (second_cache.probes_run, second_cache.reused_from_disk, calls) == (0, 4, [])
    assert _variants(second) == _variants(first) and second.rejected != []
    assert sorted(r["module"] for r in second.rejected) == sorted(r["module"] for r in first.rejected)
    norms = {c.module for c in second.components if c.kind == "rms_norm"}
    assert norms and norms <= {a.module for a in second_cache.answers if a.earlier_run}


def test_a_class_without_a_source_file_is_never_answered_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))

    class LocalRms(Rms):  # defined in a function: its code has no file identity
        pass

    def tower() -> nn.Module:
        model = Tower()
        model.n0, model.n1 = LocalRms(32, 1e-6), LocalRms(32, 1e-6)
        return model

    _disk_run(tower())
    _, cache = _disk_run(tower())
    assert cache.probes_run == 1 and cache.reused_from_disk == 3  # LocalRms probed again, once for n0 and n1


def test_editing_a_class_file_probes_again(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path / "cache"))
    package = tmp_path / "edited_norms"
    package.mkdir()
    source = "import torch\nfrom torch import nn\n\n\nclass Scaled(nn.Module):\n" + "\n".join(
        [
            "    def __init__(self):",
            "        super().__init__()",
            "        self.gain = nn.Parameter(torch.ones(32))",
            "",
            "    def forward(self, h):",
            "        return self.gain * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)",
            "",
        ]
    )
    (package / "norms.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    from edited_norms.norms import Scaled

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(32, 32), Scaled())

    _disk_run(model())
    _, kept = _disk_run(model())
    (package / "norms.py").write_text(source + "\n# an edit beside the class\n")
    _, edited = _disk_run(model())
    assert (kept.probes_run, kept.reused_from_disk) == (0, 1)
    assert (edited.probes_run, edited.reused_from_disk) == (1, 0)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_a_zoo_model_recognised_again_from_disk_probes_nothing_and_reads_the_same(zoo, tmp_path, monkeypatch, name):
    """Every kind's verdict (norms, attention, rotary, MoE, the head with its loss) survives the round trip."""
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    runs = []
    for _ in range(2):
        model = load(zoo(name))
        cache = recognition.ProbeCache(DiskCache("probe_verdicts"))
        runs.append((recognition.recognise(model, trace_model(model), cache=cache), cache))
    (first, first_cache), (second, second_cache) = runs
    assert first_cache.probes_run > 0 and first_cache.reused_from_disk == 0
    assert second_cache.probes_run == 0 and second_cache.reused_from_disk == first_cache.probes_run
    assert _variants(second) == _variants(first)
    assert {"attention", "lm_head_cross_entropy"} <= {c.kind for c in second.components if c.confirmed}
