"""Inventory: ATen records with owners, shapes, dtypes, core flags; meta tracing of a giant; ONNX."""

from __future__ import annotations

import json
import resource
import time

import torch
from ops_testlib import load, recognised
from torch import nn

from operators.inventory import ROOT, model_loss, trace_model
from operators.meta_trace import trace_meta_model

# DeepSeek-V3's published config.json (671B parameters), as a config-only source.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}  # fmt: skip


def test_llama_inventory_records_owners_shapes_and_core_flags(zoo):
    model, inv, _ = recognised(str(zoo("llama")))
    assert inv.with_backward and {r.phase for r in inv.ops} == {"forward", "backward"}
    q_proj = [r for r in inv.ops if r.module == "model.layers.0.self_attn.q_proj" and r.phase == "forward"]
    assert [r.overload for r in q_proj if r.overload == "aten.mm.default"] == ["aten.mm.default"]
    mm = next(r for r in q_proj if r.overload == "aten.mm.default")
    assert mm.core and mm.input_shapes == [[48, 64], [64, 64]] and mm.dtypes == ["float32"]
    assert mm.flops == 2 * 48 * 64 * 64
    sdpa = [r for r in inv.ops if r.overload.startswith("aten._scaled_dot_product")]
    assert sdpa and all(r.module.endswith("self_attn") for r in sdpa if r.phase == "forward")
    assert not any(r.core for r in sdpa)  # fused attention is not core ATen
    # backward ops are attributed to the module whose forward created them
    assert any(r.phase == "backward" and r.module == "model.layers.0.mlp.gate_proj" for r in inv.ops)
    unattributed = sum(r.count for r in inv.ops if r.phase == "backward" and r.module.startswith("<"))
    assert unattributed <= 1  # only the seed gradient of the loss
    assert inv.modules[ROOT].input_shapes[0] == [2, 24]
    assert all(p.grad is None for p in model.parameters())  # tracing leaves no gradients behind
    json.dumps(inv.to_dict())


def test_deepseek_v3_config_only_inventory_is_fast_and_allocates_no_weights(tmp_path):
    from adapt.model.intake import build_meta_model, resolve_source

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    model = build_meta_model(resolve_source(str(tmp_path), config_only=True))
    inv = trace_meta_model(model)
    elapsed = time.perf_counter() - start
    assert elapsed < 60.0
    assert all(p.device.type == "meta" for p in model.parameters())
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 2**20
    assert grown_gib < 2.0  # 671B parameters would be >1 TB
    assert inv.device == "meta" and inv.traced_blocks == ["model.layers.0", "model.layers.3"]  # dense + MoE
    counts = inv.overload_counts()
    assert counts["aten.topk.default"] == 3  # group scores, group selection, experts
    assert counts["aten._grouped_mm.default"] >= 2
    mm_widths = {tuple(r.input_shapes[1]) for r in inv.ops if r.overload == "aten.mm.default"}
    assert (7168, 1536) in mm_widths  # q_a_proj at real width


def test_onnx_export_is_checked_and_lists_op_types(zoo):
    from operators.onnx_export import export_onnx

    model = load(zoo("custom"))
    report = export_onnx(model, torch.randint(0, 256, (2, 12)))
    assert report.exported and report.checker == "ok" and report.opset >= 18
    assert {"MatMul", "Softmax", "Asinh"} <= set(report.op_types)


def test_onnx_failure_is_reported_not_raised():
    from operators.onnx_export import export_onnx

    class DataDependentBranch(torch.nn.Module):
        def forward(self, input_ids):
            if input_ids.sum() > 3:  # Python control flow on tensor data: not exportable
                return input_ids.float() * 2
            return input_ids.float()

    report = export_onnx(DataDependentBranch(), torch.randint(0, 5, (2, 3)))
    assert not report.exported and report.error


def test_a_model_whose_loss_needs_more_than_tokens_is_traced_through_its_plain_forward():
    """An image-to-text model shifts its labels past image tokens a text-only batch lacks: its labelled call
    raises, and the trace takes every op of the plain forward instead of failing the stage."""

    class PictureCaptioner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lookup = nn.Embedding(16, 8)
            self.out = nn.Linear(8, 16)

        def get_input_embeddings(self):
            return self.lookup

        def forward(self, input_ids, labels=None):
            logits = self.out(self.lookup(input_ids))
            if labels is not None:
                raise ValueError("Expected input batch_size (0) to match target batch_size (12).")
            return (logits,)

    model = PictureCaptioner()
    ids = torch.randint(0, 16, (2, 6))
    loss = model_loss(model, ids)
    torch.testing.assert_close(loss, model(ids)[0].float().pow(2).mean())
    inventory = trace_model(model, seq_len=6)
    assert {"aten.embedding.default", "aten.addmm.default"} <= {op.overload for op in inventory.ops}
