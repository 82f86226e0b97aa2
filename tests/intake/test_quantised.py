"""Checkpoints whose weights are stored quantised, as Day-0 releases often ship them (fp8 blocks with scales,
MXFP4 expert banks).

Intake names the quantisation and does not call its scales unused; loading has transformers' own quantizer turn the
weights back into floating point, checked against a float64 dequantisation of the file; a method transformers
cannot dequantize on load is refused in one line.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapt.core.errors import BadInput
from adapt.model.intake import build_spec, load_model, resolve_source
from benchmarks.quantise import (
    BLOCK,
    E2M1,
    E8M0_BIAS,
    SCALE_SUFFIX,
    quantisable,
    quantise_checkpoint_fp8,
    quantise_checkpoint_mxfp4,
    scale_name,
)


def _dequantised64(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape
    wide = scale.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return codes.double() * wide


@pytest.fixture
def fp8_checkpoint(zoo, tmp_path):
    ckpt = tmp_path / "llama_fp8"
    shutil.copytree(zoo("llama"), ckpt)
    return ckpt, quantise_checkpoint_fp8(ckpt)


def test_intake_names_the_quantisation_and_counts_its_scales_as_its_own(fp8_checkpoint):
    ckpt, stored = fp8_checkpoint
    spec = build_spec(resolve_source(str(ckpt)))
    report = spec.checkpoint
    scales = sorted(n for n in stored if n.endswith(SCALE_SUFFIX))
    assert scales and report.quantization_tensors == scales
    assert report.unexpected == [] and report.missing == [] and report.shape_mismatches == []
    assert report.quantization["quant_method"] == "fp8"
    verdict = spec.summary().verdict
    assert "weights stored quantised (fp8: e4m3, 128x128 blocks)" in verdict and "unused" not in verdict


@pytest.mark.parametrize("gpu_visible", [False, True], ids=["cpu-host", "fp8-capable-gpu-visible"])
def test_loading_dequantises_through_transformers_to_the_files_values(fp8_checkpoint, monkeypatch, gpu_visible):
    """With an fp8-capable GPU in sight transformers would keep its inference-only fp8 linears (weights that take no
    gradient); the weights must come back as trainable floating point wherever the model is loaded."""
    ckpt, stored = fp8_checkpoint
    if gpu_visible:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    notes: list[str] = []
    model = load_model(resolve_source(str(ckpt)), dtype=torch.float32, notes=notes)
    assert any("dequantized to float32" in n for n in notes), notes
    params = dict(model.named_parameters())
    checked = 0
    for name, codes in stored.items():
        if codes.dtype != torch.float8_e4m3fn:
            continue
        weight = params[name]
        assert weight.dtype == torch.float32 and weight.requires_grad, name  # trainable floating point, not fp8
        expected = _dequantised64(codes, stored[scale_name(name)])
        torch.testing.assert_close(weight.double(), expected, rtol=2e-7, atol=0.0)
        checked += 1
    assert checked == sum(1 for n, t in stored.items() if t.dtype == torch.float8_e4m3fn) > 0


def test_a_method_transformers_cannot_dequantise_is_refused_in_one_line(zoo, tmp_path):
    """GPTQ stores packed integers in place of each linear weight: intake reads that as the quantisation's form,
    and loading for alignment and training is refused, naming the method."""
    ckpt = tmp_path / "llama_gptq"
    shutil.copytree(zoo("llama"), ckpt)
    state = load_file(ckpt / "model.safetensors")
    stored = {}
    for name, tensor in state.items():
        if quantisable(name, tensor):
            rows, cols = tensor.shape
            module = name.removesuffix(".weight")
            stored[module + ".qweight"] = torch.randint(0, 2**31 - 1, (cols // 8, rows), dtype=torch.int32)
            stored[module + ".scales"] = torch.rand(1, rows, dtype=torch.float16)
        else:
            stored[name] = tensor
    save_file(stored, ckpt / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": -1}
    (ckpt / "config.json").write_text(json.dumps(config))

    src = resolve_source(str(ckpt))
    report = build_spec(src).checkpoint
    assert (
        report.missing == []
        and report.unexpected == []
        and len(report.quantization_tensors) == len(stored) - sum(1 for n, t in state.items() if not quantisable(n, t))
    )
    with pytest.raises(BadInput, match=r"stored quantised \(gptq\).*unquantised checkpoint"):
        load_model(src)


def test_experts_stored_one_by_one_with_their_scales_load_as_the_float_checkpoint_would(zoo, tmp_path):
    """DeepSeek-V3's own layout: each expert's projections on disk with their own scales, which transformers fuses
    into expert banks as it loads.  The quantised file must load to the parameters a float32 file holding the float64
    dequantisation loads to."""
    quantised, reference = tmp_path / "ds_fp8", tmp_path / "ds_float"
    shutil.copytree(zoo("deepseek_v3"), quantised)
    shutil.copytree(zoo("deepseek_v3"), reference)
    stored = quantise_checkpoint_fp8(quantised)
    scales = [n for n in stored if n.endswith(SCALE_SUFFIX)]
    assert any(".experts.0." in n for n in scales)  # experts one by one, each with its scales
    report = build_spec(resolve_source(str(quantised))).checkpoint
    assert report.unexpected == [] and report.missing == [] and sorted(scales) == report.quantization_tensors
    dequantised = {
        name: (_dequantised64(tensor, stored[scale_name(name)]) if tensor.dtype == torch.float8_e4m3fn else tensor)
        for name, tensor in stored.items()
        if not name.endswith(SCALE_SUFFIX)
    }
    save_file({n: t.float().contiguous() for n, t in dequantised.items()}, reference / "model.safetensors")
    got = dict(load_model(resolve_source(str(quantised)), dtype=torch.float32).named_parameters())
    want = dict(load_model(resolve_source(str(reference)), dtype=torch.float32).named_parameters())
    assert got.keys() == want.keys() and any(p.dim() == 3 for p in got.values())  # fused expert banks
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=2e-7, atol=0.0, msg=name)


def _mxfp4_dequantised64(blocks: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """A bank ``[E, in, out]`` from its packed e2m1 codes (low nibble first) and e8m0 exponents, in float64."""
    values = torch.tensor(E2M1, dtype=torch.float64)
    pairs = torch.stack([values[(blocks & 0x0F).long()], values[(blocks >> 4).long()]], dim=-1).flatten(-2)
    scaled = pairs * torch.exp2(exponents.double() - E8M0_BIAS)[..., None]
    return scaled.flatten(-2).transpose(1, 2)


def test_mxfp4_expert_banks_load_exactly_to_their_dequantised_values(tmp_path):
    """gpt-oss ships its experts in MXFP4 (4-bit codes, a power-of-two scale per 32 values).  Intake names it and
    counts the blocks and scales as the quantisation's own tensors; loading dequantises every bank to trainable
    float32 equal to the float64 decoding of the file (e2m1 times a power of two is exact in float32)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
        max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    ckpt = tmp_path / "gpt_oss_mxfp4"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(ckpt)
    stored = quantise_checkpoint_mxfp4(ckpt)
    packed = sorted(n for n in stored if n.endswith(("_blocks", "_scales")))
    assert len(packed) == 4 * config.num_hidden_layers  # gate_up and down, blocks and scales, per layer
    spec = build_spec(resolve_source(str(ckpt)))
    report = spec.checkpoint
    assert report.quantization["quant_method"] == "mxfp4" and report.quantization_tensors == packed
    assert report.unexpected == [] and report.missing == [] and "stored quantised (mxfp4)" in spec.summary().verdict
    notes: list[str] = []
    params = dict(load_model(resolve_source(str(ckpt)), dtype=torch.float32, notes=notes).named_parameters())
    assert any("mxfp4" in n and "dequantized to float32" in n for n in notes), notes
    for name in (n.removesuffix("_blocks") for n in packed if n.endswith("_blocks")):
        bank = params[name]
        assert bank.dtype == torch.float32 and bank.requires_grad, name
        expected = _mxfp4_dequantised64(stored[f"{name}_blocks"], stored[f"{name}_scales"])
        assert expected.abs().max() > 0
        torch.testing.assert_close(bank.double(), expected, rtol=0.0, atol=0.0, msg=name)
