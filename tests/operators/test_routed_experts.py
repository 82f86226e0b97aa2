"""Expert banks called with their block's own routing (``experts(hidden, index, weights)``): where the block's router
is one adapt does not compute (PhiMoE's sparse mixer, LongCat's zero-computation experts), the experts alone are
recognised against float64 for fresh indices and run on the grouped-GEMM kernels, the model's routing choosing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from ops_testlib import recognised
from torch import nn
from transformers import AutoModelForCausalLM, LongcatFlashConfig, PhimoeConfig, Qwen3MoeConfig

from adapt.model.intake import inspect
from operators import load_profile, plan_kernels
from operators.agreement import compare_with_spec
from operators.inventory import trace_callable
from operators.providers import triton_moe
from operators.recognition import recognise
from operators.registry import Target

pytest.importorskip("triton")

SMALL = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
BUILDS = {
    "phimoe": lambda: PhimoeConfig(
        **SMALL, intermediate_size=48, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2
    ),
    "longcat_flash": lambda: LongcatFlashConfig(
        vocab_size=96,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        num_layers=1,
        ffn_hidden_size=48,
        expert_ffn_hidden_size=16,
        n_routed_experts=4,
        moe_topk=2,
        zero_expert_num=2,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        head_dim=8,
    ),  # fmt: skip
}


@pytest.fixture(autouse=True)
def every_test_draws_fresh(fresh_seed):
    return fresh_seed


def _saved(name: str, tmp_path) -> str:
    model = AutoModelForCausalLM.from_config(BUILDS[name](), dtype=torch.float32)
    model.save_pretrained(tmp_path / name)
    return str(tmp_path / name)


def _experts_components(recognition):
    return [c for c in recognition.components if c.kind == "routed_experts"]


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_a_block_with_its_own_routing_runs_its_experts_on_the_kernels(name, tmp_path):
    path = _saved(name, tmp_path)
    model, _, recognition = recognised(path)
    banks = {p.shape[0] for n, p in model.named_parameters() if n.startswith("model.layers.0.mlp.experts.")}
    if len(banks) > 1:  # transformers 5.17's LongCat sizes the gate/up bank for the zero-computation experts too
        assert not _experts_components(recognition)
        pytest.skip(f"banks over {sorted(banks)} experts: not one bank of experts, so not recognised as one")
    found = _experts_components(recognition)
    assert found and all(c.confirmed for c in found), recognition.rejected
    assert not [c for c in recognition.components if c.kind == "moe" and c.confirmed]  # the router is the model's
    comp = found[0]
    experts = model.get_submodule(comp.module)
    block = model.get_submodule(comp.module.rpartition(".")[0]).eval()
    reference = copy.deepcopy(block).double()
    for module in reference.modules():  # transformers' grouped-GEMM experts have no float64 path
        if hasattr(module, "config"):
            module.config._experts_implementation = "eager"
    x = torch.randn(2, 9, comp.variant.width)
    x64 = x.double().requires_grad_()
    want = reference(x64)
    want = want[0] if isinstance(want, tuple) else want
    want.pow(2).sum().backward()
    experts.forward = triton_moe.experts_forward(experts, comp)
    x32 = x.clone().requires_grad_()
    got = block(x32)
    got = (got[0] if isinstance(got, tuple) else got).double()
    got.pow(2).sum().backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)
    expected = dict(reference.named_parameters())
    for param_name, param in experts.named_parameters():
        full = f"{comp.module.rpartition('.')[2]}.{param_name}"
        assert float(param.grad.abs().max()) > 0, full
        torch.testing.assert_close(param.grad.double(), expected[full].grad, rtol=1e-4, atol=1e-4, msg=full)


def test_the_plan_patches_them_and_intake_agrees(tmp_path):
    path = _saved("phimoe", tmp_path)
    model, inventory, recognition = recognised(path)
    plan = plan_kernels(inventory, recognition, load_profile("cuda-hopper"), Target("cpu", "float32", training=True))
    chosen = [c for c in plan.components if c.kind == "routed_experts"]
    assert chosen and {(c.kernel, c.patch) for c in chosen} == {("moe_experts_grouped_gemm", True)}
    agreement = compare_with_spec(inspect(path), recognition)
    assert agreement.disagreements == []
    assert agreement.compared["mlp.kind"] == agreement.compared["moe.num_experts"] == 2


def test_a_recognised_router_keeps_its_experts_inside_its_own_kernel(tmp_path):
    config = Qwen3MoeConfig(**SMALL, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
                            num_experts=4, num_experts_per_tok=2)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "qwen3_moe")
    _, _, recognition = recognised(str(tmp_path / "qwen3_moe"))
    assert [c.kind for c in recognition.components if c.kind in ("moe", "routed_experts")] == ["moe"]


class CappedExperts(nn.Module):
    """Experts whose SwiGLU clamps its inputs (DeepSeek-V4's limit), or whose unit is gpt-oss's
    ``(up + 1) * gate * sigmoid(1.702 gate)``, which no GLU kernel computes."""

    def __init__(self, limit: float | None, unit: str = "silu", width: int = 16, inner: int = 8, experts: int = 4):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, width) * width**-0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, width, inner) * inner**-0.5)
        self.limit, self.unit = limit, unit

    def forward(self, hidden, index, weights):
        out = torch.zeros_like(hidden)
        for slot in range(index.shape[1]):
            gate, up = torch.einsum("th,toh->to", hidden, self.gate_up_proj[index[:, slot]]).chunk(2, dim=-1)
            if self.limit is not None:
                gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            unit = F.silu(gate) * up if self.unit == "silu" else (up + 1) * gate * torch.sigmoid(1.702 * gate)
            out = out + weights[:, slot : slot + 1] * torch.einsum("ti,thi->th", unit, self.down_proj[index[:, slot]])
        return out


class Block(nn.Module):
    def __init__(self, limit: float | None, unit: str = "silu"):
        super().__init__()
        self.experts = CappedExperts(limit, unit)

    def forward(self, hidden, index, weights):
        return self.experts(hidden, index, weights)


def _recognised_block(block: Block):
    hidden, index = torch.randn(12, 16), torch.rand(12, 4).topk(2, dim=-1).indices
    recognition = recognise(block, trace_callable(block, hidden, index, torch.rand(12, 2)))
    return [c for c in recognition.components if c.kind == "routed_experts" and c.confirmed], recognition


@pytest.mark.parametrize("limit", [None, 7.0])
def test_a_clamped_swiglu_is_read_with_its_limit_and_runs_clamped(limit):
    block = Block(limit)
    confirmed, recognition = _recognised_block(block)
    assert confirmed and confirmed[0].variant.activation == "silu", recognition.rejected
    assert confirmed[0].variant.limit == limit
    # at 30x the clamp binds: the kernel path must clamp exactly where the module does
    hidden, index = 30 * torch.randn(20, 16), torch.rand(20, 4).topk(2, dim=-1).indices
    weights = torch.rand(20, 2)
    reference = copy.deepcopy(block.experts).double()
    want = reference(hidden.double(), index, weights.double())
    got = triton_moe.experts_forward(block.experts, confirmed[0])(hidden, index, weights)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_a_unit_no_kernel_computes_is_refused():
    confirmed, recognition = _recognised_block(Block(7.0, unit="gpt_oss"))
    assert not confirmed
    assert any(r["candidate"] == "routed_experts" for r in recognition.rejected), recognition.rejected


def test_deepseek_v4s_clamped_experts_run_beside_its_hash_and_scored_routers(tmp_path):
    """DeepSeek-V4: hash-routed blocks (expert by token id) and sqrt-softplus-scored ones, both handing their choice
    to experts whose SwiGLU clamps at ``swiglu_limit``; the experts run on the kernels, clamped, in every block."""
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(
        vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, q_lora_rank=24,
        o_lora_rank=16, o_groups=8, qk_rope_head_dim=8, index_head_dim=16, index_n_heads=4, num_hidden_layers=4,
        moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, sliding_window=16,
        max_position_embeddings=128, swiglu_limit=10.0,
        layer_types=["heavily_compressed_attention"] * 3 + ["compressed_sparse_attention"],
        mlp_layer_types=["hash_moe"] * 3 + ["moe"],
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "dsv4")
    path = str(tmp_path / "dsv4")
    model, _, recognition = recognised(path)
    found = _experts_components(recognition)
    assert len(found) == 4 and all(c.confirmed and c.variant.limit == 10.0 for c in found), recognition.rejected
    model = model.float().eval()
    reference = copy.deepcopy(model).double()
    for module in reference.modules():
        if hasattr(module, "config"):
            module.config._experts_implementation = "eager"
    with torch.no_grad():  # banks large enough that the clamp binds
        for mm in (model, reference):
            for comp in found:
                mm.get_submodule(comp.module).gate_up_proj.mul_(40.0)
    for comp in found:
        experts = model.get_submodule(comp.module)
        experts.forward = triton_moe.experts_forward(experts, comp)
    ids = torch.randint(0, 96, (2, 12))
    got, want = model(input_ids=ids).logits.double(), reference(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    agreement = compare_with_spec(inspect(path), recognition)
    assert not [d for d in agreement.disagreements if d.field.startswith(("mlp", "moe"))], agreement.disagreements
    assert agreement.compared["moe.num_experts"] == 4


def test_zaya_reads_as_its_experts_compute_not_as_its_router_mlp(tmp_path):
    """Zaya routes through a small MLP with its own GELU; its experts run SiLU.  Intake reads the block's activation
    beside the expert banks, so intake and the experts' probe agree."""
    from transformers import ZayaConfig

    config = ZayaConfig(
        vocab_size=96, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        layer_types=["hybrid", "hybrid_sliding"], moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1,
        router_hidden_size=32, sliding_window=16, max_position_embeddings=128, hidden_act="silu",
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "zaya")
    path = str(tmp_path / "zaya")
    spec = inspect(path)
    assert {b.mlp.activation for b in spec.blocks if b.mlp.kind == "moe"} == {"silu"}
    recognition = recognised(path)[2]
    assert {c.variant.activation for c in _experts_components(recognition) if c.confirmed} == {"silu"}
    agreement = compare_with_spec(spec, recognition)
    assert not [d for d in agreement.disagreements if d.field.startswith(("mlp", "moe"))], agreement.disagreements
