"""Recognition by structure and numerics: the kinds each zoo family must yield, and look-alikes rejected."""

from __future__ import annotations

import pytest
import torch
from ops_testlib import kinds, recognised
from torch import nn

from operators import plan_kernels
from operators.inventory import trace_callable, trace_model
from operators.profiles import load_profile
from operators.recognition import recognise
from operators.recognition.variants import RopeStyle
from operators.registry import Target


def by_module(recognition, kind):
    return {c.module: c for c in kinds(recognition, kind)}


def test_llama_kinds(zoo):
    _, _, rec = recognised(str(zoo("llama")))
    norms = by_module(rec, "rms_norm")
    assert set(norms) >= {"model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"}
    assert all(
        n.variant.offset == 0.0 and n.variant.cast == "round_then_scale" and n.variant.eps == 1e-6
        for n in norms.values()
    )
    (mlp,) = [c for c in kinds(rec, "gated_mlp") if c.module == "model.layers.0.mlp"]
    assert mlp.variant.activation == "silu" and (mlp.variant.gate, mlp.variant.up) == ("gate_proj", "up_proj")
    attn = by_module(rec, "attention")["model.layers.0.self_attn"].variant
    assert attn.causal and attn.window is None and attn.layout == "gqa" and attn.num_kv_heads == 2
    assert attn.rope.style == "half" and not attn.rope.partial
    assert by_module(rec, "rotary")["model.rotary_emb"].variant.table_layout == "half"
    assert "model.layers.0.post_attention_layernorm" in by_module(rec, "residual_add_norm")
    assert kinds(rec, "lm_head_cross_entropy", confirmed_only=False)[0].module == "lm_head"
    assert not kinds(rec, "new", confirmed_only=False)


def test_identical_mlps_are_probed_once_and_a_different_one_again(zoo):
    _, _, rec = recognised(str(zoo("llama")))
    mlps = by_module(rec, "gated_mlp")
    assert "probed on" not in mlps["model.layers.0.mlp"].evidence
    assert "probed on model.layers.0.mlp" in mlps["model.layers.1.mlp"].evidence
    assert mlps["model.layers.1.mlp"].variant == mlps["model.layers.0.mlp"].variant
    # DeepSeek-V3's dense MLP (layer 0) and its shared expert differ in width: each gets its own probe.
    _, _, ds = recognised(str(zoo("deepseek_v3")))
    evidence = {c.module: c.evidence for c in ds.components if c.kind == "gated_mlp"}
    assert "probed on" not in evidence["model.layers.0.mlp"]
    assert "probed on" not in evidence["model.layers.1.mlp.shared_experts"]
    assert "probed on model.layers.1.mlp.shared_experts" in evidence["model.layers.2.mlp.shared_experts"]


def test_gemma2_offset_norm_softcap_and_alternating_windows(zoo):
    _, _, rec = recognised(str(zoo("gemma2")))
    norms = kinds(rec, "rms_norm")
    assert len(norms) == 9 and all(n.variant.offset == 1.0 and n.variant.cast == "scale_then_round" for n in norms)
    assert {c.variant.activation for c in kinds(rec, "gated_mlp")} == {"gelu_tanh"}
    attn = by_module(rec, "attention")
    assert attn["model.layers.0.self_attn"].variant.window == 16  # sliding layer
    assert attn["model.layers.1.self_attn"].variant.window is None  # global layer
    assert all(a.variant.softcap == 50.0 for a in attn.values())
    head = kinds(rec, "lm_head_cross_entropy", confirmed_only=False)[0]
    assert head.variant.final_softcap == 30.0


def test_mistral_sliding_window_mqa(zoo):
    _, _, rec = recognised(str(zoo("mistral")))
    for attn in kinds(rec, "attention"):
        assert attn.variant.window == 16 and attn.variant.layout == "mqa" and attn.variant.causal


def test_deepseek_v3_mla_and_grouped_sigmoid_moe(zoo):
    _, _, rec = recognised(str(zoo("deepseek_v3")))
    attn = by_module(rec, "attention")["model.layers.1.self_attn"].variant
    assert attn.mla and attn.rope == RopeStyle(style="interleaved", rotary_dim=8, partial=True, decoupled=True)
    assert attn.head_dim == 24 and attn.v_head_dim == 16 and attn.causal
    assert "model.layers.0.mlp" in by_module(rec, "gated_mlp")  # first_k_dense_replace layer
    moe = by_module(rec, "moe")
    assert set(moe) == {"model.layers.1.mlp", "model.layers.2.mlp"}
    v = moe["model.layers.1.mlp"].variant
    assert (v.scoring, v.top_k, v.n_group, v.topk_group, v.group_score) == (
        "sigmoid",
        2,
        4,
        2,
        "top2_sum",
    )
    assert v.selection_bias and v.normalize_topk and v.routed_scale == 2.5 and v.activation == "silu"
    assert v.shared_experts == "model.layers.1.mlp.shared_experts" and v.num_experts == 8


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_softmax_routed_moe(zoo, family):
    _, _, rec = recognised(str(zoo(family)))
    moes = kinds(rec, "moe")
    assert len(moes) == 2
    assert all(
        m.variant.scoring == "softmax" and m.variant.top_k == 2 and m.variant.shared_experts is None for m in moes
    )


def test_qwen_families(zoo):
    model, _, qwen3 = recognised(str(zoo("qwen3")))
    assert all(a.variant.qk_norm for a in kinds(qwen3, "attention"))
    # a per-head norm normalises one row per head for each token: its candidates are timed on that many rows
    rows = {n.module.rsplit(".", 1)[-1]: n.variant.rows_per_token for n in kinds(qwen3, "rms_norm")}
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    assert rows == {"q_norm": heads, "k_norm": kv_heads, "input_layernorm": 1, "post_attention_layernorm": 1, "norm": 1}
    _, _, qwen2 = recognised(str(zoo("qwen2")))
    assert len(kinds(qwen2, "attention")) == 2 and len(kinds(qwen2, "gated_mlp")) == 2


def test_gpt2_layernorm_and_plain_gelu_mlp(zoo):
    _, _, rec = recognised(str(zoo("gpt2")))
    assert len(kinds(rec, "layer_norm")) == 5 and not kinds(rec, "rms_norm")
    mlps = kinds(rec, "mlp")
    assert len(mlps) == 2 and all(m.variant.activation == "gelu_tanh" for m in mlps)
    assert all(
        a.variant.causal and a.variant.rope is None and a.variant.layout == "mha" for a in kinds(rec, "attention")
    )


def test_bert_bidirectional_attention(zoo):
    _, _, rec = recognised(str(zoo("bert")))
    attns = kinds(rec, "attention")
    assert len(attns) == 6 and all(not a.variant.causal and a.variant.window is None for a in attns)
    assert all(n.variant.eps == 1e-12 for n in kinds(rec, "layer_norm"))


def test_custom_remote_code_renamed_components_and_novel_op(zoo):
    _, _, rec = recognised(str(zoo("custom")))
    norms = by_module(rec, "rms_norm")
    assert "trunk.strata.0.level_a" in norms and norms["trunk.level_out"].variant.weight == "gain"
    forge = by_module(rec, "gated_mlp")["trunk.strata.0.forge"].variant
    assert (forge.gate, forge.up, forge.down, forge.activation) == ("valve", "feed", "drain", "silu")
    gaze = by_module(rec, "attention")["trunk.strata.0.gaze"].variant
    assert gaze.causal and gaze.layout == "gqa" and not gaze.hook
    new = kinds(rec, "new", confirmed_only=False)
    assert [c.module for c in new] == ["trunk.strata.0.quench", "trunk.strata.1.quench"]
    assert "aten.asinh.default" in new[0].variant.ops


# ---------------------------------------------------------------------------------------------
# Look-alikes: a renamed RMSNorm must match; norms that compute something else must not.
# ---------------------------------------------------------------------------------------------


class FooNorm(nn.Module):
    """LlamaRMSNorm, renamed, with other attribute names."""

    def __init__(self, width, tiny=1e-6):
        super().__init__()
        self.scale_vec = nn.Parameter(torch.ones(width))
        self.tiny = tiny

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.tiny)
        return self.scale_vec * h.to(dtype)


class CentredRawRms(FooNorm):
    """Mean-centred numerator, un-centred RMS denominator: neither RMSNorm nor LayerNorm."""

    def forward(self, h):
        return (
            self.scale_vec * (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.tiny)
        )


class EpsOutsideSqrt(FooNorm):
    def forward(self, h):
        return self.scale_vec * h / (torch.sqrt(h.pow(2).mean(-1, keepdim=True)) + self.tiny)


class DoubledScale(FooNorm):
    def forward(self, h):
        return 2.0 * self.scale_vec * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.tiny)


class SumNotMean(FooNorm):
    def forward(self, h):
        return self.scale_vec * h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + self.tiny)


class CentredLayerNorm(FooNorm):
    """Centred numerator and centred variance: this *is* a bias-free LayerNorm."""

    def forward(self, h):
        c = h - h.mean(-1, keepdim=True)
        return self.scale_vec * c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + self.tiny)


class Holder(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.norm = norm

    def forward(self, x):
        return self.norm(self.proj(x))


def recognise_norm(norm: nn.Module):
    model = Holder(norm)
    inv = trace_callable(model, torch.randn(2, 7, 32))
    rec = recognise(model, inv)
    return [c for c in rec.components if c.module == "norm"], rec.rejected


class GatedNorm(FooNorm):
    """An RMSNorm whose callers pass a gate (Mamba-2's): with gate=None it is a plain RMSNorm, as a probe sees it."""

    def forward(self, h, gate=None):
        out = super().forward(h)
        return out if gate is None else out * torch.nn.functional.silu(gate)


class GatedHolder(Holder):
    def forward(self, x):
        h = self.proj(x)
        return self.norm(h, h.flip(-1))


def test_a_norm_called_with_a_gate_is_not_claimed():
    """The norm kernels take x alone: a norm the model calls with a second tensor stays native, never patched."""
    model = GatedHolder(GatedNorm(32))
    rec = recognise(model, trace_callable(model, torch.randn(2, 7, 32)))
    assert [c.kind for c in rec.components if c.module == "norm"] == ["new"]  # listed as new, runs as traced
    assert [r["module"] for r in rec.rejected if r["module"] == "norm"] == ["norm"]
    assert recognise_norm(GatedNorm(32))[0][0].kind == "rms_norm"  # called without the gate, it is one


def test_renamed_rmsnorm_is_recognised():
    comps, rejected = recognise_norm(FooNorm(32, tiny=1e-5))
    assert [(c.kind, c.variant.eps, c.variant.weight) for c in comps] == [("rms_norm", 1e-5, "scale_vec")]
    assert not rejected


@pytest.mark.parametrize("lookalike", [CentredRawRms, EpsOutsideSqrt, DoubledScale, SumNotMean])
def test_lookalike_norms_fall_through_to_the_generic_path(lookalike):
    comps, rejected = recognise_norm(lookalike(32))
    assert [c.kind for c in comps] == ["new"]  # generic path: decomposition or a generated kernel
    assert [r["module"] for r in rejected] == ["norm"]


def test_centred_variance_is_layernorm_not_rmsnorm():
    comps, _ = recognise_norm(CentredLayerNorm(32))
    assert [(c.kind, c.variant.bias) for c in comps] == [("layer_norm", None)]


class GluMlp(nn.Module):
    """Three projections; ``gate_act`` decides what the gate computes."""

    def __init__(self, gate_act):
        super().__init__()
        self.a, self.b, self.c = (
            nn.Linear(32, 64, bias=False),
            nn.Linear(32, 64, bias=False),
            nn.Linear(64, 32, bias=False),
        )
        self.gate_act = gate_act

    def forward(self, x):
        return self.c(self.gate_act(self.a(x)) * self.b(x))


def recognise_mlp(gate_act):
    model = nn.Sequential(nn.Linear(32, 32), GluMlp(gate_act))
    rec = recognise(model, trace_callable(model, torch.randn(2, 5, 32)))
    return [c for c in rec.components if c.module == "1"], rec.rejected


def test_swiglu_in_a_plain_container_is_recognised():
    comps, _ = recognise_mlp(torch.nn.functional.silu)
    assert [(c.kind, c.variant.activation, c.variant.gate, c.variant.up) for c in comps] == [
        ("gated_mlp", "silu", "a", "b")
    ]


def test_sigmoid_glu_is_named_and_no_fused_kernel_claims_it():
    """sigmoid(a) * b is a GLU, not SwiGLU/GeGLU: recognised under its own activation, it runs natively."""
    from operators.providers import providers
    from operators.registry import Target

    comps, _ = recognise_mlp(torch.sigmoid)
    assert [(c.kind, c.variant.activation) for c in comps] == [("gated_mlp", "sigmoid")]
    cuda = Target("cuda", "bfloat16", True, (9, 0))
    offered = [opt.status for p in providers() for opt in p.options(comps[0], cuda)]
    assert offered and "fused" not in offered


def test_gate_activation_no_reference_names_is_rejected():
    """softsign(a) * b: no known activation computes it, so no gated-MLP component may be claimed."""
    comps, rejected = recognise_mlp(torch.nn.functional.softsign)
    assert not [c for c in comps if c.kind in ("gated_mlp", "mlp")]
    assert [r["module"] for r in rejected] == ["1"]


@pytest.mark.parametrize("with_scale", [True, False])
def test_rmsnorm_that_takes_the_root_as_a_power_is_recognised(with_scale):
    """Gemma 4's norm computes ``x * torch.pow(mean(x^2) + eps, -0.5)``: an RMSNorm, with or without a scale."""
    from transformers.models.gemma4_unified.modeling_gemma4_unified import Gemma4UnifiedRMSNorm

    eps = 10.0 ** -torch.randint(4, 7, ()).item()
    comps, rejected = recognise_norm(Gemma4UnifiedRMSNorm(32, eps=eps, with_scale=with_scale))
    assert [(c.kind, c.variant.eps, c.variant.weight) for c in comps] == [
        ("rms_norm", eps, "weight" if with_scale else None)
    ]
    assert not rejected


class _SplitBank(nn.Module):
    """Rows split by per-group counts given as Python integers, one weight per group (no known kind)."""

    def __init__(self, groups: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(groups, width, width) / width**0.5)

    def forward(self, rows, counts):
        return torch.cat([part @ self.weight[i] for i, part in enumerate(torch.split(rows, counts))])


class _Scramble(nn.Module):
    """The same bank's arithmetic with its counts fixed inside: tensors are its only inputs."""

    def __init__(self, groups: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(groups, width, width) / width**0.5)

    def forward(self, rows):
        return torch.cat([rows[i::2] @ self.weight[i] for i in range(2)])


class _Counted(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 8):
        super().__init__()
        self.lookup = nn.Embedding(vocab, width)
        self.bank, self.scramble = _SplitBank(2, width), _Scramble(2, width)

    def get_input_embeddings(self):
        return self.lookup

    def forward(self, input_ids, **_):
        rows = self.lookup(input_ids).reshape(-1, self.lookup.embedding_dim)
        first = int((input_ids.reshape(-1) % 2 == 0).sum())  # counts that change with the batch
        return (self.scramble(self.bank(rows, [first, rows.shape[0] - first])),)


def test_a_new_module_that_takes_python_counts_runs_as_traced_not_through_inductor():
    model = _Counted()
    inventory = trace_model(model, seq_len=6)
    recognition = recognise(model, inventory)
    plan = plan_kernels(inventory, recognition, load_profile("cuda-hopper"), Target("cpu", "float32", True, None))
    bank, scramble = plan.component("bank", "new"), plan.component("scramble", "new")
    assert bank.variant.python_sizes and not scramble.variant.python_sizes
    assert (bank.provider, bank.status, bank.patch) == (None, "native", False)
    assert (scramble.provider, scramble.status, scramble.patch) == ("inductor", "generated", True)


def test_a_new_module_inductor_cannot_capture_is_replanned_alone():
    """Once capture finds a new component Dynamo cannot compile whole, only its choice is remade: every other
    component keeps what the first plan chose (timed once), and the uncompilable one runs as traced."""
    model = _Counted()
    inventory = trace_model(model, seq_len=6)
    recognition = recognise(model, inventory)
    profile, target = load_profile("cuda-hopper"), Target("cpu", "float32", True, None)
    first = plan_kernels(inventory, recognition, profile, target)
    first.component("bank", "new").note = "chosen by the first plan"  # a mark a fresh choice would not carry
    again = plan_kernels(
        inventory, recognition, profile, target, as_traced={"scramble": "data-dependent"}, earlier=first
    )
    assert again.component("bank", "new").note == "chosen by the first plan"
    scramble = again.component("scramble", "new")
    assert (scramble.kernel, scramble.status, scramble.patch) == ("as traced", "native", False)
    assert "data-dependent" in scramble.note


def test_attention_scored_by_baddbmm_is_read_from_its_query_and_keys():
    """BLOOM scores with ``baddbmm`` (ALiBi added first) and keys stored transposed: its geometry is the query's and
    the keys', not the probabilities' (the sequence length had read as the head size, and BLOOM as GQA)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    heads = int(torch.randint(2, 5, ()))
    head_dim = 8 * int(torch.randint(1, 3, ()))
    config = AutoConfig.for_model("bloom", hidden_size=heads * head_dim, n_head=heads, n_layer=1, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config).eval()
    components = recognise(model, trace_model(model)).components
    (attention,) = [c for c in components if c.kind == "attention"]
    v = attention.variant
    assert (v.layout, v.num_heads, v.num_kv_heads, v.head_dim, v.v_head_dim) == (
        "mha",
        heads,
        heads,
        head_dim,
        head_dim,
    )
