"""The static-cache decode path: same tokens as transformers' dynamic cache, composing with the kernel plan; timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adapt.model.intake import resolve_source
from adapt.model.skeleton import load_model
from validators.decode import StaticDecoder, decode_comparison, time_hf_generate, time_static_decoder


def model_and_prompts(zoo, name: str, batch: int = 2, length: int = 10):
    model = load_model(resolve_source(str(zoo(name))), torch.float32, "cpu").eval()
    vocab = model.get_input_embeddings().num_embeddings
    return model, torch.randint(0, vocab, (batch, length))


def dynamic_greedy(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding on transformers' dynamic cache, step by step: the argmax every step, end-of-sequence
    included (``generate(min_new_tokens=...)`` would suppress it and pick the runner-up instead)."""
    from transformers import DynamicCache

    cache, step, out = DynamicCache(config=model.config), ids, []
    with torch.no_grad():
        for _ in range(new_tokens):
            step = model(input_ids=step, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            out.append(step)
    return torch.cat(out, 1)


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3"])
def test_static_decoder_matches_dynamic_cache_greedy(zoo, name, fresh_seed):
    model, ids = model_and_prompts(zoo, name, length=12)
    new_tokens = 24  # past gemma2's 16-token sliding window
    tokens = StaticDecoder(model, 2, 12 + new_tokens, compile=False).generate(ids, new_tokens)
    assert torch.equal(tokens, dynamic_greedy(model, ids, new_tokens))


def test_decoder_reuses_its_cache_across_prompts(zoo, fresh_seed):
    model, ids = model_and_prompts(zoo, "llama")
    decoder = StaticDecoder(model, 2, 20, compile=False)
    first = decoder.generate(ids, 6)
    other = torch.flip(ids, dims=[1])
    assert torch.equal(
        decoder.generate(other, 6), dynamic_greedy(model, other, 6)
    )  # nothing left from the first prompt
    assert torch.equal(decoder.generate(ids, 6), first)
    with pytest.raises(ValueError, match="does not fit"):
        decoder.prefill(torch.zeros(3, 4, dtype=torch.long))


@pytest.mark.slow  # the operators stage with probes, under Triton's CPU interpreter
def test_patched_model_composes_with_the_static_decoder(zoo, fresh_seed):
    from operators import apply_kernel_plan, run_ops

    model, ids = model_and_prompts(zoo, "llama")
    expected = StaticDecoder(model, 2, 18, compile=False).generate(ids, 8)
    plan = run_ops(str(zoo("llama")), onnx=False, check_patch=False).plan
    handle = apply_kernel_plan(model, plan)
    try:
        assert handle.patched, "the plan patched nothing: the composition would not be tested"
        assert torch.equal(StaticDecoder(model, 2, 18, compile=False).generate(ids, 8), expected)
    finally:
        handle.revert()


@pytest.mark.slow
def test_compiled_decode_step_gives_the_eager_tokens(zoo, fresh_seed):
    model, ids = model_and_prompts(zoo, "llama")
    eager = StaticDecoder(model, 2, 18, compile=False).generate(ids, 8)
    compiled = StaticDecoder(model, 2, 18, compile=True, mode="default")
    assert compiled.compiled
    assert torch.equal(compiled.generate(ids, 8), eager)


def test_timings_split_prefill_and_decode(zoo, fresh_seed):
    model, ids = model_and_prompts(zoo, "llama")
    adapted = time_static_decoder("adapted", model, ids, 6, compile=False, repeats=2)
    eager = time_hf_generate("hf-eager", model, ids, 6, static=False, repeats=2)
    for timing in (adapted, eager):
        assert timing.prefill_s > 0 and timing.decode_s > 0 and timing.decode_tokens_per_s > 0
        assert timing.decode_tokens_per_s == pytest.approx(2 * 5 / timing.decode_s)
        assert [len(row) for row in timing.tokens] == [6, 6]
        assert timing.decode_spread >= 1.0 and timing.gpu_idle_share is None  # the profiler's share is CUDA's
    assert adapted.tokens == eager.tokens
    with pytest.raises(ValueError):
        time_static_decoder("adapted", model, ids, 1, compile=False)


@pytest.mark.parametrize("static", [False, True])
def test_end_of_sequence_is_decoded_like_any_token_by_both_paths(zoo, fresh_seed, static):
    """A model whose argmax is EOS: generate() must neither stop there nor suppress it for the runner-up."""
    model, ids = model_and_prompts(zoo, "llama")
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    with torch.no_grad():
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))
        model.lm_head.bias[eos] = 50.0
    adapted = time_static_decoder("adapted", model, ids, 4, compile=False, repeats=1)
    hf = time_hf_generate("hf", model, ids, 4, static=static, repeats=1)
    assert adapted.tokens == hf.tokens == [[eos] * 4] * 2


@pytest.mark.slow
def test_benchmark_dry_run_writes_json_and_markdown(tmp_path):
    """benchmarks/inference.py --tiny on one shape: every step in its own process, rows, targets, both files."""
    repo = Path(__file__).parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)}
    cmd = [sys.executable, str(repo / "benchmarks" / "inference.py"), "--out", str(tmp_path), "--tiny",
           "--shapes", "llama-1b", "--parallel", "2", "--budget-s", "500", "--work", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads((tmp_path / "inference-tiny.json").read_text())
    entry = data["shapes"]["llama-1b"]
    for variant in ("hf-eager", "hf-static-compile", "adapted"):
        rows = entry[variant]["rows"]
        assert [r["batch"] for r in rows] == [1, 2] and all(r["decode_tokens_per_s"] > 0 for r in rows)
    assert [(t["batch"], t["verdict"]) for t in entry["targets"]] == [(1, "inconclusive"), (2, "inconclusive")]
    assert all(t["vs_static_compile"] > 0 and t["vs_eager"] > 0 for t in entry["targets"])  # measured, on a CPU
    assert entry["generation"]["verdict"] in ("passed", "inconclusive")
    table = (tmp_path / "inference-tiny.md").read_text()
    assert "| llama-1b | 1 |" in table and "not measured" not in table


def test_decode_comparison_runs_every_variant_on_the_same_prompts(zoo):
    src = resolve_source(str(zoo("qwen2")))
    timings = decode_comparison(src, None, "cpu", torch.float32, batches=(1, 2), prompt_len=8, new_tokens=4, repeats=1)
    assert [(t.variant, t.batch) for t in timings] == [
        (v, b) for v in ("hf-eager", "hf-static-compile", "adapted") for b in (1, 2)
    ]
    by_batch = {}
    for t in timings:
        by_batch.setdefault(t.batch, []).append(t.tokens)
    assert all(
        tokens[0] == tokens[1] == tokens[2] for tokens in by_batch.values()
    )  # same greedy tokens, three cache paths
