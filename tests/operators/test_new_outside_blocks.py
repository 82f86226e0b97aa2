"""Outside the blocks, a container whose own code computes around a projection no component holds is reported as
``new`` (it runs as traced): no matmul work goes silently unaccounted.  One that only builds positions or masks
around blocks is not; tiny RoBERTa's inline LM-head transform and RoCBert's embedding mix are reported."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ops_testlib import CPU
from torch import nn

from operators.api import run_ops
from operators.inventory import trace_callable
from operators.recognition import recognise
from operators.recognition.component import inside

SPEC = importlib.util.spec_from_file_location(
    "bench_sweep_tiny", Path(__file__).parents[2] / "benchmarks" / "sweep_tiny.py"
)
sweep = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = sweep
SPEC.loader.exec_module(sweep)


@pytest.fixture(autouse=True)
def every_test_draws_fresh(fresh_seed):
    return fresh_seed


def silent_flops(inventory, components) -> list[str]:
    """Modules running matmul FLOPs inside neither a confirmed component nor a reported ``new`` one."""
    accounted = {c.module for c in components if c.confirmed or c.kind == "new"}
    return sorted({o.module for o in inventory.ops if o.flops and not inside(o.module, accounted, strict=False)})


def new_containers(components) -> set[str]:
    return {c.module for c in components if c.kind == "new" and c.variant.container}


class Feed(nn.Module):
    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, inner), nn.Linear(inner, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(h)))


class Layer(nn.Module):
    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.norm, self.feed = nn.LayerNorm(width), Feed(width, inner)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.feed(self.norm(h))


class Trunk(nn.Module):
    """Blocks, with positions built around them: index bookkeeping, no projection of its own."""

    def __init__(self, width: int, inner: int, span: int) -> None:
        super().__init__()
        self.where = nn.Embedding(span, width)
        self.layers = nn.ModuleList(Layer(width, inner) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.where(torch.arange(h.shape[1], device=h.device).expand(h.shape[:2]))
        for layer in self.layers:
            h = layer(h)
        return h


class Mixin(nn.Module):
    """Two lookups concatenated and projected back to the width, in the container's own code."""

    def __init__(self, vocab: int, width: int, side: int) -> None:
        super().__init__()
        self.word, self.shape = nn.Embedding(vocab, width), nn.Embedding(vocab, side)
        self.mix = nn.Linear(width + side, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mix(torch.cat([self.word(ids), self.shape(ids)], -1))


class Readout(nn.Module):
    """RoBERTa's head written the same way: dense, activation and norm inline, then the vocabulary projection."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.dense, self.norm, self.out = nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(F.gelu(self.dense(h))))


class Model(nn.Module):
    def __init__(self, vocab: int, width: int, inner: int, side: int) -> None:
        super().__init__()
        self.mixin, self.trunk, self.readout = Mixin(vocab, width, side), Trunk(width, inner, 32), Readout(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.readout(self.trunk(self.mixin(ids)))


def test_containers_computing_around_a_bare_projection_are_new_and_position_bookkeeping_is_not(rng):
    vocab, width = rng.randrange(40, 90), rng.choice([16, 24, 32])
    model = Model(vocab, width, rng.choice([40, 48]), rng.choice([4, 8])).eval()
    ids = torch.randint(0, vocab, (2, rng.randrange(5, 12)))
    inventory = trace_callable(model, ids)
    components = recognise(model, inventory).components
    assert new_containers(components) == {"mixin", "readout"}
    assert all(c.kind == "new" or c.confirmed for c in components)
    assert not silent_flops(inventory, components)


@pytest.mark.parametrize(("model_type", "reported"), [("roberta", "lm_head"), ("roc_bert", "roc_bert.embeddings")])
def test_a_tiny_bert_like_lm_accounts_for_every_flop(model_type, reported, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(sweep.tiny_config(model_type)).save_pretrained(tmp_path)
    report = run_ops(tmp_path, target=CPU, onnx=False)
    components = report.recognition.components
    assert report.patch_check.passed
    assert new_containers(components) == {reported}
    assert report.plan.component(reported, "new").status == "native"  # its own code runs as traced
    assert not silent_flops(report.inventory, components)
