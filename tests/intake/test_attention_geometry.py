"""An attention's kind and head size are what it computes: a matrix off the width that reads no latent (a
relative-position bias table) does not make it multi-head latent attention, and the measured head size stands."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from novel_models import TokenStack
from torch import nn

from adapt.model.intake import describe_model
from adapt.model.skeleton import quiet_transformers

SPEC = importlib.util.spec_from_file_location(
    "bench_sweep_tiny", Path(__file__).parents[2] / "benchmarks" / "sweep_tiny.py"
)
sweep = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = sweep
SPEC.loader.exec_module(sweep)


class _BiasedAttention(nn.Module):
    """Grouped-query attention under unconventional names, plus a per-token bias over key distances mixed from
    a (d_rel, extent) table (a 2-D parameter that touches neither the width nor any latent), a static filter over
    the keys' channels (a raw 2-D parameter as wide as the keys) and a per-head score offset read from the width by
    a projection registered after the output projection."""

    def __init__(self, width: int, heads: int, kv_heads: int, head: int, d_rel: int, extent: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head = heads, kv_heads, head
        self.a, self.b, self.c = (nn.Linear(width, n * head, bias=False) for n in (heads, kv_heads, kv_heads))
        self.rel = nn.Linear(width, heads * d_rel, bias=False)
        self.table = nn.Parameter(torch.randn(d_rel, extent))
        self.back = nn.Linear(heads * head, width, bias=False)
        self.filter = nn.Parameter(torch.randn(3, kv_heads * head))
        self.offset = nn.Linear(width, heads, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q = self.a(h).view(b, s, self.heads, self.head).transpose(1, 2)
        k = (self.b(h) * self.filter.sum(0)).view(b, s, self.kv_heads, self.head).transpose(1, 2)
        v = self.c(h).view(b, s, self.kv_heads, self.head).transpose(1, 2)
        k, v = (t.repeat_interleave(self.heads // self.kv_heads, 1) for t in (k, v))
        bias = (self.rel(h).view(b, s, self.heads, -1) @ self.table).transpose(1, 2)[..., :s]
        scores = (q @ k.transpose(-1, -2)) / self.head**0.5 + bias + self.offset(h).transpose(1, 2)[..., None]
        hidden = torch.ones(s, s, dtype=torch.bool, device=h.device).triu(1)
        out = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v
        return self.back(out.transpose(1, 2).reshape(b, s, -1))


def _stack(vocab: int, width: int, attention: dict[str, int]) -> TokenStack:
    layers = [
        nn.ModuleDict({"norm": nn.LayerNorm(width), "mix": _BiasedAttention(width, **attention)}) for _ in range(2)
    ]
    for layer in layers:
        layer.forward = lambda h, layer=layer: h + layer["mix"](layer["norm"](h))
    return TokenStack(vocab, width, layers)


def test_a_relative_bias_table_is_no_latent_projection(rng):
    heads, kv_heads = rng.choice([(4, 2), (4, 1), (8, 2), (4, 4)])
    # d_rel odd: the bias projection's width (heads * d_rel) is never whole heads, as in the models that carry one
    geometry = {"heads": heads, "kv_heads": kv_heads, "head": rng.choice([16, 32]), "d_rel": rng.choice([3, 5, 7])}
    with torch.device("meta"):
        model = _stack(rng.randrange(50, 200), rng.choice([48, 64]), {**geometry, "extent": rng.randrange(9, 40)})
    forwards = [layer.forward for layer in model.layers]
    spec = describe_model(model, model.config)
    assert [layer.forward for layer in model.layers] == forwards, "intake leaves a forward set on a block in place"
    kind = "mha" if kv_heads == heads else "mqa" if kv_heads == 1 else "gqa"
    for block in spec.blocks:
        a = block.attention
        assert (a.kind, a.num_heads, a.num_kv_heads, a.head_dim) == (kind, heads, kv_heads, geometry["head"])


def test_inkling_attention_reads_as_the_grouped_heads_it_computes():
    """Inkling's attention convolves k and v and adds a relative-position bias from a (d_rel, extent) table; its
    sliding and full layers have their own head sizes."""
    from transformers import AutoModelForCausalLM

    config = sweep.tiny_config("inkling_text")
    with quiet_transformers():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        spec = describe_model(model, config)
    for block, layer in zip(spec.blocks, model.model.layers):
        computed = layer.self_attn  # the sizes its forward views q, k and v with
        a = block.attention
        assert (a.kind, a.head_dim) == ("gqa", computed.head_dim)
        assert (a.num_heads, a.num_kv_heads) == (computed.num_heads, computed.num_key_value_heads)
        assert a.qk_norm


def test_a_low_rank_output_projection_leaves_the_heads_to_the_measurement():
    """DeepSeek V4 reads one shared key-value head and writes its output through a grouped low-rank projection,
    whose input width is no multiple of the heads: the query heads are those the attention core was seen to run."""
    from transformers import AutoModelForCausalLM

    config = sweep.tiny_config("deepseek_v4")
    with quiet_transformers():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        spec = describe_model(model, config)
    read = [(b.attention, layer.self_attn) for b, layer in zip(spec.blocks, model.model.layers) if b.attention]
    assert read  # its compressed sparse layer is read as another mixer, apart from this test
    for a, computed in read:
        assert (a.kind, a.num_heads, a.num_kv_heads, a.head_dim) == ("mqa", computed.num_heads, 1, computed.head_dim)


def test_sinks_are_a_logit_in_the_softmax_denominator_not_any_per_head_vector():
    """GPT-OSS concatenates a learned logit per head to the scores before the softmax; Granite-SWA rescales the
    output by the scores' logsumexp against its per-head sink, the same sum another way.  Doge keeps a per-head
    vector (its dynamic mask's rate) of the same size that never enters the softmax."""
    from transformers import AutoModelForCausalLM

    read = {}
    for model_type in ("gpt_oss", "granite_swa", "doge"):
        config = sweep.tiny_config(model_type)
        with quiet_transformers():
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            spec = describe_model(model, config)
        heads = {b.attention.num_heads for b in spec.blocks if b.attention}
        per_head = [n for n, p in model.named_parameters() if "attn" in n and p.shape in {(h,) for h in heads}]
        assert per_head, f"{model_type}: the tiny config keeps a per-head vector in its attention"
        read[model_type] = {b.attention.sinks for b in spec.blocks if b.attention}
    assert read == {"gpt_oss": {True}, "granite_swa": {True}, "doge": {False}}
