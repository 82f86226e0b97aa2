"""Specs the planner tests share: decoders written from dimensions, and DeepSeek-V3 through intake."""

from __future__ import annotations

import dataclasses
import json

import pytest

from parallel_planner.published import PublishedRun, run_spec


def decoder_spec(layers=8, hidden=1024, ffn=2816, heads=16, kv_heads=4, vocab=32000, seq=2048, gated=True):
    """A Llama-style (gated) or GPT-style (plain) decoder spec with the given dimensions."""
    run = PublishedRun(
        source="llama3" if gated else "megatron2021", model="test", params_b=0, layers=layers, hidden=hidden,
        ffn=ffn, heads=heads, kv_heads=kv_heads, vocab=vocab, seq=seq, gpu="h100", gpus=8, tp=1, pp=1, dp=8, cp=1,
        ep=1, zero=1, global_batch_seqs=8, recompute="none", reported_tflops_per_gpu=1, reported_pct_peak=1,
    )
    return run_spec(run)


@pytest.fixture(scope="session")
def deepseek_v3_dir(tmp_path_factory):
    """DeepSeek-V3's published config, config-only (no weights)."""
    from transformers import DeepseekV3Config

    path = tmp_path_factory.mktemp("deepseek_v3")
    DeepseekV3Config().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def deepseek_v3_spec(deepseek_v3_dir):
    from adapt.intake import inspect

    return inspect(str(deepseek_v3_dir), config_only=True)


@pytest.fixture(scope="session")
def spec_json(tmp_path_factory):
    """A ModelSpec JSON file (what ``adapt inspect --json`` writes) of a 1B-class decoder."""
    path = tmp_path_factory.mktemp("spec") / "spec.json"
    path.write_text(json.dumps(dataclasses.asdict(decoder_spec(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8))))
    return path
