"""One anatomy for models written under names no convention knows: what intake and recognition report."""

from __future__ import annotations

import pytest
import torch
from novel_models import GROUPS, HEADS, SPAN, SPECIALISTS, WIDTH, Glance, LookLayer, tide, weave
from torch import nn
from torch.nn import functional as F

from adapt.model.blocks import NoBlockList, find_blocks, residual_width
from adapt.model.intake import describe_model
from adapt.model.measure import block_signatures
from operators import plan_kernels
from operators.inventory import trace_model
from operators.profiles import load_profile
from operators.recognition import recognise
from operators.registry import Target


@pytest.fixture(scope="module")
def model():
    return weave()


@pytest.fixture(scope="module")
def recognition(model):
    return recognise(model, trace_model(model))


def _component(recognition, module, kind):
    return next(c for c in recognition.components if c.module == module and c.kind == kind)


def test_a_hybrid_stack_of_two_layer_classes_is_one_block_list(model):
    blocks = find_blocks(model)
    assert blocks.path == "strands" and len(blocks) == 4
    assert blocks.classes() == ["LookLayer", "RippleLayer"]


def test_a_list_of_experts_is_never_the_block_list():
    """Eight experts in each of two layers, more parameters than the layer list around them holds elsewhere."""

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.experts = nn.ModuleList([nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 8)) for _ in range(8)])

    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.rows = nn.ModuleList([Layer(), Layer()])

    blocks = find_blocks(Tower())
    assert blocks.path == "rows" and len(blocks) == 2


def test_the_stack_the_tokens_run_through_wins_over_a_larger_tower_beside_it(rng):
    """A picture tower with more and wider layers than the text stack: the blocks are the ones next to the
    token embedding; without an embedding the model names, the larger stack is taken."""

    def stack(width: int, depth: int) -> nn.ModuleList:
        return nn.ModuleList(
            [nn.Sequential(nn.Linear(width, 2 * width), nn.Linear(2 * width, width)) for _ in range(depth)]
        )

    text_width, text_depth = rng.randint(4, 16), rng.randint(1, 4)

    class Reader(nn.Module):
        def __init__(self, named_embedding: bool):
            super().__init__()
            self.named_embedding = named_embedding
            self.optics = nn.Module()
            self.optics.retina = nn.Module()
            self.optics.retina.rings = stack(text_width * 4, text_depth + rng.randint(1, 3))
            self.words = nn.Module()
            self.words.lookup = nn.Embedding(32, text_width)
            self.words.chain = stack(text_width, text_depth)

        def get_input_embeddings(self):
            if not self.named_embedding:
                raise NotImplementedError
            return self.words.lookup

    blocks = find_blocks(Reader(named_embedding=True))
    assert blocks.path == "words.chain" and len(blocks) == text_depth
    assert find_blocks(Reader(named_embedding=False)).path == "optics.retina.rings"


def test_no_block_list_is_said_as_such():
    with pytest.raises(NoBlockList):
        find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_intake_reads_mixers_heads_and_routing_from_the_numbers(model):
    spec = describe_model(model, model.config)
    assert [b.mixer for b in spec.blocks] == ["full_attention", "convolution", "full_attention", "convolution"]
    attention = spec.blocks[0].attention
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (HEADS, GROUPS, SPAN)
    assert attention.kind == "gqa" and spec.blocks[1].attention is None
    # 2 attention layers, GROUPS KV heads of SPAN keys and SPAN values, 2 bytes each (no dtype stated)
    assert spec.cost.kv_cache_bytes_per_token == 2 * GROUPS * 2 * SPAN * 2
    moe = spec.blocks[0].mlp
    assert (moe.kind, moe.num_experts, moe.top_k, moe.router_scoring, moe.activation) == (
        "moe",
        SPECIALISTS,
        2,
        "sigmoid",
        "silu",
    )
    assert spec.blocks[1].mlp.kind == "dense_gated" and spec.hidden_size == residual_width(model) == WIDTH
    assert "convolution token mixer in 2/4 blocks" in spec.novelties
    assert not any("GQA" in n for n in spec.novelties) and "GQA attention in 2/4 blocks" in spec.features


def test_a_gated_linear_recurrence_is_a_recurrent_mixer_and_new():
    model = tide()
    spec = describe_model(model, model.config)
    assert [b.mixer for b in spec.blocks] == ["full_attention", "recurrent"]
    assert spec.blocks[1].attention is None and "recurrent token mixer in 1/2 blocks" in spec.novelties
    recognition = recognise(model, trace_model(model))
    assert "strands.1.ebb" in {c.module for c in recognition.components if c.kind == "new"}


def test_experts_in_a_module_list_are_one_routed_moe(recognition):
    moe = _component(recognition, "strands.0.council", "moe")
    assert moe.confirmed and moe.variant.num_experts == SPECIALISTS
    assert (moe.variant.top_k, moe.variant.scoring, moe.variant.expert_container) == (
        2,
        "sigmoid",
        "module_list",
    )
    assert not any(c.module.startswith("strands.0.council.members") for c in recognition.components)


def test_rotary_written_out_is_found_by_its_numbers(recognition):
    rotation = _component(recognition, "strands.0.look", "rotary_application")
    assert rotation.confirmed and rotation.variant.global_name == "turn" and rotation.variant.style == "half"
    attention = _component(recognition, "strands.0.look", "attention")
    assert attention.variant.rope.rotary_dim == SPAN
    assert (attention.variant.num_heads, attention.variant.num_kv_heads) == (HEADS, GROUPS)


def test_an_unknown_mixer_is_new_with_its_path_not_silently_native(recognition):
    new = {c.module for c in recognition.components if c.kind == "new"}
    assert {"strands.1.ripple", "strands.1.ripple.smear"} <= new
    assert not any(c.confirmed for c in recognition.components if c.kind == "new")


def test_coverage_counts_flops_of_a_new_mixer_as_run_natively_but_not_recognised(model, recognition):
    inventory = trace_model(model)
    plan = plan_kernels(inventory, recognition, load_profile("cuda-hopper"), Target("cpu", "float32", True, None))
    coverage = plan.coverage()
    known = [c.module for c in recognition.components if c.confirmed]

    def inside_known(module: str) -> bool:
        return any(module == path or module.startswith(f"{path}.") for path in known)

    expected = sum(r.flops for r in inventory.ops if not r.module.startswith("<") and inside_known(r.module))
    assert 0 < expected < coverage["flops_total"]  # the ripple mixer's FLOPs are outside every known component
    assert coverage["flops_share_recognised"] == round(expected / coverage["flops_total"], 4)
    assert coverage["flops_share_recognised"] < coverage["flops_share_fused_or_native"]


def test_a_module_whose_forward_needs_more_than_the_hidden_states_is_rejected_not_fatal():
    """A gated norm (needs its gate) and an MLP that adds the residual itself: probes reject, never crash."""

    class GatedScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(16))

        def forward(self, h, gate):
            return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.sigmoid(gate)

    class Carry(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, h, residual):
            return residual + self.down(torch.relu(self.up(h)))

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.gated = GatedScale()
            self.carry = Carry()
            self.out = nn.Linear(16, 50)

        def get_input_embeddings(self):
            return self.embed

        def forward(self, input_ids):
            h = self.embed(input_ids)
            h = self.gated(h, h * 0.5)
            return (self.out(self.carry(h, h)),)

    torch.manual_seed(0)
    odd = Odd()
    result = recognise(odd, trace_model(odd))
    rejected = {r["module"] for r in result.rejected}
    assert {"gated", "carry"} <= rejected
    assert not any(c.confirmed and c.module in ("gated", "carry") for c in result.components)


def test_hyper_connection_children_are_not_attention():
    """Qwen4-Exp mixes four residual streams in children whose projections never touch the model width: intake
    reads no attention into them (linear-attention layers stay recurrent, the indexed layer keeps its attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(int(torch.randint(0, 2**16, ())))
    config = AutoConfig.for_model(
        "qwen4_exp_text", vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, hc_lowrank=16, indexer_n_heads=1, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    spec = describe_model(model, config)
    mixers = [b.mixer for b in spec.blocks]
    # the indexed layer's label differs by transformers version ("qwen_sparse_attention" in 5.17): not linear is it
    assert [b.attention is not None for b in spec.blocks] == [t != "linear_attention" for t in config.layer_types]
    assert mixers[0] == "recurrent" and spec.blocks[-1].attention.num_heads == config.num_attention_heads
    assert all(b.params == sum(p.numel() for p in blk.parameters()) for b, blk in zip(spec.blocks, model.model.layers))


class SpinnableGlance(Glance):
    """Attention whose rotary is switched per layer by an integer flag, as some models leave rope out of some layers."""

    def __init__(self, spin: int, depth: int):
        super().__init__()
        self.spin, self.depth = spin, depth  # a variant (repeats across layers) and an index (unique per layer)

    def forward(self, h, cos, sin):
        if self.spin:
            return super().forward(h, cos, sin)
        b, t, _ = h.shape  # the same attention with q and k left unrotated
        q = self.seek(h).view(b, t, HEADS, SPAN).transpose(1, 2)
        k, v = (p(h).view(b, t, GROUPS, SPAN).transpose(1, 2).repeat_interleave(HEADS // GROUPS, 1)
                for p in (self.hold, self.give))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.fold(out.transpose(1, 2).reshape(b, t, HEADS * SPAN))


@pytest.mark.parametrize("named_table", [False, True])
def test_layers_configured_without_rotary_are_measured_apart_and_read_without_it(rng, named_table):
    """With or without a frequency table under the conventional name (which says "rope" for the whole model)."""
    spins = [1] * rng.randint(2, 4) + [0]
    rng.shuffle(spins)
    model = weave()
    if named_table:
        model.clock.register_buffer("inv_freq", model.clock.rates.clone(), persistent=False)
    model.strands = nn.ModuleList([LookLayer() for _ in spins])
    for depth, (strand, spin) in enumerate(zip(model.strands, spins)):
        strand.look = SpinnableGlance(spin, depth)
    found = find_blocks(model)
    assert len(set(block_signatures(found))) == 2  # the flag splits the layers in two; the index does not
    spec = describe_model(model, model.config)
    assert [b.positional for b in spec.blocks] == ["rope" if spin else "none" for spin in spins]
