"""Streamed alignment: block by block from the shards, with a proven memory bound."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import first_norm, scale_norm_output
from safetensors.torch import load_file, save_file

from adapt.core.errors import BadInput
from adapt.model.intake import resolve_source
from adapt.model.skeleton import build_skeleton, load_model
from validators.align import AlignOptions, align
from validators.modules import find_blocks
from validators.shards import ShardReader

FAST = AlignOptions(batch=2, seq_len=16, backward=False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "name", ["llama", "gemma2", "qwen3", "gpt2", "bert", "custom", "mixtral", "qwen3_moe", "deepseek_v3"]
)
def test_streamed_alignment_passes(zoo, name, dtype):
    """MoE checkpoints store one tensor per expert; transformers' own conversion stacks them per block."""
    src = resolve_source(str(zoo(name)), trust_remote_code=name == "custom")
    report = align(src, dtype=dtype, streamed=True, options=FAST)
    assert report.passed, (report.first_divergent, report.notes)
    assert report.streamed
    blocks = len(find_blocks(build_skeleton(src)).blocks)
    assert {layer.block for layer in report.layers if layer.block is not None} == set(range(blocks))
    # Both copies see the reference's own inputs, so each block's error is local: no growth with depth.
    assert all(layer.err_ratio == pytest.approx(1.0) or layer.rel_err == 0.0 for layer in report.layers)


def test_streamed_names_the_broken_block(zoo):
    src = resolve_source(str(zoo("custom")), trust_remote_code=True)
    report = align(src, dtype="fp32", streamed=True, transform=scale_norm_output(1, 1.01), options=FAST)
    norm_name, _ = first_norm(find_blocks(build_skeleton(src)).blocks[1])
    assert not report.passed
    assert report.first_divergent == f"trunk.strata.1.{norm_name}"
    assert report.first_divergent_block == 1
    # Fed the reference's hidden states, block 0 agrees exactly as before.
    assert all(layer.passed for layer in report.layers if layer.block == 0)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_streamed_converts_experts_exactly_like_from_pretrained(zoo, name):
    src = resolve_source(str(zoo(name)))
    skeleton = build_skeleton(src)
    reader = ShardReader(src, skeleton)
    banks = [t for t in reader.converted if ".layers.1." in t]
    assert banks, reader.converted  # per-expert tensors on disk, stacked into 3-D banks by the conversion
    loaded = dict(load_model(src, torch.float32, "cpu").named_parameters())
    for param, tensor in reader.load(banks).items():
        assert tensor.dim() == 3 and torch.equal(tensor.float(), loaded[param].detach()), param


def _corrupt_copy(src_dir, dst, key: str):
    shutil.copytree(src_dir, dst)
    shard = dst / "model.safetensors"
    tensors = load_file(str(shard))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[5] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return dst


def test_corrupt_expert_in_converted_checkpoint_names_its_block(zoo, tmp_path):
    ckpt = _corrupt_copy(zoo("qwen3_moe"), tmp_path / "qwen3-moe-bad", "model.layers.1.mlp.experts.2.up_proj.weight")
    report = align(resolve_source(str(ckpt)), dtype="bf16", streamed=True, options=FAST)
    assert not report.passed
    assert report.first_divergent_block == 1 and report.first_divergent_component == "mlp"
    assert report.first_divergent == "model.layers.1.mlp.experts"
    assert report.nonfinite_module == "model.layers.1.mlp.experts"
    assert report.corrupt_tensor == "model.layers.1.mlp.experts.2.up_proj.weight"  # the on-disk key, not the bank
    # Block 0 was compared before the corrupt block was read, and agreed.
    assert {layer.block for layer in report.layers if layer.block is not None} == {0}
    assert all(layer.passed for layer in report.layers)


def test_missing_tensor_is_bad_input(zoo, tmp_path):
    ckpt = tmp_path / "llama-missing"
    shutil.copytree(zoo("llama"), ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadInput, match="model.layers.1.mlp.up_proj.weight"):
        align(resolve_source(str(ckpt)), dtype="fp32", streamed=True, options=FAST)


def _write_wide_llama(path, layers: int, hidden: int, ffn: int) -> int:
    """A llama checkpoint written shard by shard (one block per shard); returns its weight bytes."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=128,
    )
    config.save_pretrained(path)
    skeleton = build_skeleton(resolve_source(str(path), config_only=True))
    shards: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, param in skeleton.named_parameters():
        shard = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(shard, []).append((name, tuple(param.shape)))
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for shard, entries in shards.items():  # one shard in memory at a time
        tensors = {
            name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * hidden**-0.5
            for name, shape in entries
        }
        fname = f"model-{shard}.safetensors"
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: fname for name in tensors})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


@pytest.mark.slow
def test_streamed_peak_memory_stays_below_the_weights(tmp_path):
    ckpt = tmp_path / "wide-llama"
    ckpt.mkdir()
    weight_bytes = _write_wide_llama(ckpt, layers=20, hidden=1024, ffn=4096)
    budget = 900 * 2**20
    assert weight_bytes > budget * 1.3  # the checkpoint alone does not fit in the budget
    cmd = [
        sys.executable,
        "-m",
        "adapt.app.cli",
        "align",
        str(ckpt),
        "--streamed",
        "--dtype",
        "bf16",
        "--no-kernels",
        "--seq",
        "16",
        "--batch",
        "1",
        "--json",
    ]
    log, result = tmp_path / "stderr.txt", tmp_path / "stdout.json"
    with open(log, "wb") as err, open(result, "wb") as out:
        proc = subprocess.run(
            cmd, stdout=out, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=600, check=False
        )
    assert proc.returncode == 0, log.read_text()[-2000:]
    report = json.loads(result.read_text())
    assert report["passed"] and report["streamed"]
    assert len({layer["block"] for layer in report["layers"] if layer["block"] is not None}) == 20
    # The child's own high-water mark (VmHWM): ru_maxrss would include this pytest process's peak.
    assert 0 < report["peak_rss_bytes"] < budget, report["peak_rss_bytes"] / 2**20
