"""The static-cache decode path: same tokens as transformers' dynamic cache, composing with the kernel plan; timings."""

from __future__ import annotations

import importlib.util
import json
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
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(ids))  # fmt: skip
    return out[:, ids.shape[1] :]


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
    adapted = time_static_decoder("adapted", model, ids, 6, compile=False, repeats=1)
    eager = time_hf_generate("hf-eager", model, ids, 6, static=False, repeats=1)
    for timing in (adapted, eager):
        assert timing.prefill_s > 0 and timing.decode_s > 0 and timing.decode_tokens_per_s > 0
        assert timing.decode_tokens_per_s == pytest.approx(2 * 5 / timing.decode_s)
        assert [len(row) for row in timing.tokens] == [6, 6]
    assert adapted.tokens == eager.tokens
    with pytest.raises(ValueError):
        time_static_decoder("adapted", model, ids, 1, compile=False)


@pytest.mark.slow
def test_benchmark_dry_run_writes_json_and_markdown(tmp_path):
    """benchmarks/inference.py at toy sizes, in process: every decode variant, generation alignment, both files."""
    spec = importlib.util.spec_from_file_location(
        "bench_inference", Path(__file__).parents[2] / "benchmarks" / "inference.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    checkpoint = tmp_path / "llama"
    bench.build_checkpoint("llama-1b", checkpoint, True)
    bench.make_kernel_plan(checkpoint)
    entry = {variant: bench.decode_variant(variant, checkpoint, True) for variant in bench.DECODE_VARIANTS}
    entry["generation"] = bench.alignment_variant(checkpoint, True)
    results = {
        "sizes": bench.sizes(True),
        "shapes": {"llama-1b": entry},
        "budget_s": 0,
        "environment": bench.environment(),
    }
    bench.write(tmp_path, "inference-tiny", results)
    data = json.loads((tmp_path / "inference-tiny.json").read_text())
    rows = data["shapes"]["llama-1b"]["adapted"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["decode_tokens_per_s"] > 0 for r in rows)
    assert data["shapes"]["llama-1b"]["generation"]["verdict"] in ("passed", "inconclusive")
    table = (tmp_path / "inference-tiny.md").read_text()
    assert "| llama-1b | 1 |" in table and "error" not in table


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
