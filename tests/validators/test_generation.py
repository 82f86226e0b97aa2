"""Generation alignment: greedy tokens, log-probs, KV-cache and left-padded batch consistency, named divergences."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers import scale_norm_output

from adapt.model.intake import resolve_source
from adapt.model.zoo import ZOO_NAMES
from validators.compare import thresholds_for
from validators.generation import (
    GenerationOptions,
    GenerationReport,
    StepJudge,
    generation_check,
)

FEW = GenerationOptions(prompts=3, prompt_len=10, new_tokens=8)


def check(zoo, name: str, options: GenerationOptions = FEW, transform=None, dtype: str = "fp32") -> GenerationReport:
    src = resolve_source(str(zoo(name)), trust_remote_code=name == "custom")
    return generation_check(src, dtype=dtype, transform=transform, options=options)


def drop_cached_position(layer: int, position: int):
    """A candidate whose KV cache loses one position's keys and values in one layer while decoding."""

    def transform(model):
        forward = model.forward

        @functools.wraps(forward)
        def leaky(*args, **kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is not None and cache.get_seq_length() > position:
                cache.layers[layer].keys[:, :, position] = 0
                cache.layers[layer].values[:, :, position] = 0
            return forward(*args, **kwargs)

        model.forward = leaky
        return model

    return transform


def ignore_padding_mask(model):
    """A candidate that drops the attention mask: left-padded rows then attend to their padding."""
    forward = model.forward

    @functools.wraps(forward)
    def unmasked(*args, **kwargs):
        kwargs.pop("attention_mask", None)
        return forward(*args, **kwargs)

    model.forward = unmasked
    return model


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_unadapted_model_generates_like_its_reference(zoo, name):
    report = check(zoo, name)
    if name == "bert":
        assert not report.applicable and report.outcome == "not applicable"
        return
    assert report.passed, report.describe()
    checked = {c.name for c in report.checks if c.checked}
    assert {"tokens", "logprobs"} <= checked
    if name != "custom":  # the custom family's model keeps no KV cache, and says so
        assert {"cache", "batch"} <= checked
    else:
        assert not next(c for c in report.checks if c.name == "cache").checked


def test_sixty_four_tokens_with_sliding_window_cache(zoo):
    report = check(zoo, "mistral", GenerationOptions(prompts=2, prompt_len=12, new_tokens=64))
    assert report.passed, report.describe()
    assert "sliding_attention" in report.cache_kinds
    tokens = next(c for c in report.checks if c.name == "tokens")
    assert tokens.steps == 2 * 64  # past the 16-token window


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_cache_that_drops_a_position_is_caught_and_named(zoo, name):
    report = check(zoo, name, transform=drop_cached_position(layer=1, position=3))
    assert not report.passed
    cache = next(c for c in report.checks if c.name == "cache")
    assert cache.checked and not cache.passed
    first = report.first_divergence
    assert first is not None and first.check == "cache"
    assert first.step == 1 and first.position == report.prompt_lengths[first.prompt] + 1  # the first cached decode
    assert first.layer is not None and first.layer.startswith("model.layers.1.") and first.block == 1
    assert "first divergent layer model.layers.1." in report.describe()


def test_broken_norm_is_named_at_the_first_step(zoo):
    report = check(zoo, "llama", transform=scale_norm_output(1, 1.5))
    assert not report.passed
    first = report.first_divergence
    assert first.step == 0 and first.check in ("tokens", "logprobs")
    assert first.block == 1 and first.layer.startswith("model.layers.1")


def test_left_padding_that_leaks_is_caught_as_batch_inconsistency(zoo):
    report = check(zoo, "llama", transform=ignore_padding_mask)
    by_name = {c.name: c for c in report.checks}
    assert by_name["cache"].passed and by_name["tokens"].passed  # single prompts carry no padding
    assert not by_name["batch"].passed and not report.passed
    assert report.first_divergence.check == "batch"
    assert report.first_divergence.prompt > 0  # the longest prompt has no padding


def test_left_padded_batch_of_different_lengths_is_consistent(zoo):
    report = check(zoo, "gemma2", GenerationOptions(prompts=4, prompt_len=14, new_tokens=6))
    assert len(set(report.prompt_lengths)) == 4
    batch = next(c for c in report.checks if c.name == "batch")
    assert batch.checked and batch.passed and batch.steps == 4 * 6


def test_undecidable_tie_is_reported_not_failed():
    limits = thresholds_for("bf16")
    reference = torch.zeros(2, 5, dtype=torch.float64)
    reference[:, 1] = reference[:, 2] = 3.0  # two top tokens tied exactly at both steps
    reference[1, 2] = 2.0  # step 1: a clear gap of one logit
    baseline = reference + 0.01 * torch.randn(2, 5, dtype=torch.float64)
    candidate = reference.clone()
    candidate[:, 2] += 0.05  # prefers token 2 at step 0 ...
    candidate[1, 2] = 3.5  # ... and, against a decidable gap, at step 1
    ties = []
    mismatch = StepJudge(limits, reference, baseline, torch.tensor([1, 1])).token_mismatch(candidate, 0, ties)
    assert [(t.step, t.reference_token, t.candidate_token) for t in ties] == [(0, 1, 2)]
    assert mismatch is not None and mismatch[0] == 1 and "instead of 1" in mismatch[1]


def test_report_round_trips_through_json(zoo):
    report = check(zoo, "llama", transform=drop_cached_position(layer=0, position=2))
    again = GenerationReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.to_dict() == report.to_dict()
    assert again.first_divergence.layer == report.first_divergence.layer
    assert report.to_dict()["verdict"] == "failed"


def test_config_only_source_gets_one_set_of_random_weights(zoo, tmp_path):
    (tmp_path / "config.json").write_text((zoo("qwen2") / "config.json").read_text())
    report = generation_check(resolve_source(str(tmp_path / "config.json")), dtype="fp32", options=FEW)
    assert report.passed, report.describe()
    assert report.random_weights


def test_cli_exit_codes(zoo, capsys):
    from adapt.app.cli import main

    assert (
        main(["generate-check", str(zoo("llama")), "--no-kernels", "--new-tokens", "4", "--prompts", "2", "--json"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "passed" and data["new_tokens"] == 4
    assert main(["generate-check", str(zoo("llama")), "--new-tokens", "0"]) == 2
    assert "--new-tokens is 0; allowed: an integer >= 1" in capsys.readouterr().err


@pytest.mark.slow  # the operators stage per family, under Triton's CPU interpreter
@pytest.mark.parametrize("name", [n for n in ZOO_NAMES if n != "bert"])
def test_adapted_model_generates_like_its_reference(zoo, name):
    from operators import run_ops

    src = resolve_source(str(zoo(name)), trust_remote_code=name == "custom")
    plan = run_ops(src, onnx=False, check_patch=False).plan
    report = generation_check(src, plan, dtype="fp32", options=FEW)
    assert report.passed, report.describe()
    assert report.patched_modules and all(": " in entry for entry in report.patched_modules)


def _raises_in_transformers(message: str):
    """A function whose frames belong to ``transformers.cache_utils``: a fault of the checkpoint's software."""
    namespace = {"__name__": "transformers.cache_utils"}
    exec(f"def broken(self, *args, **kwargs):\n    raise AttributeError({message!r})", namespace)  # noqa: S102
    return namespace["broken"]


def test_a_cache_the_models_own_library_cannot_build_fails_the_cache_check_with_its_reason(zoo, monkeypatch):
    """BLT's cache in transformers 5.25 reads a config field its config lacks: generation with the cache cannot run,
    which is the finding (a failed cache check naming why), not a crash of the stage."""
    import transformers.cache_utils

    reason = "'BltConfig' object has no attribute 'num_hidden_layers'"
    monkeypatch.setattr(transformers.cache_utils.DynamicCache, "__init__", _raises_in_transformers(reason))
    report = check(zoo, "llama")
    assert not report.passed and report.first_divergence.check == "cache"
    assert reason in report.first_divergence.detail and "transformers.cache_utils" in report.first_divergence.detail


def test_only_the_models_own_software_is_blamed():
    from adapt.model.calls import library_failure

    model = torch.nn.Linear(2, 2)
    try:
        _raises_in_transformers("no such field")(None)
    except AttributeError as err:
        assert library_failure(model, err) == "AttributeError: no such field (in transformers.cache_utils)"
    try:
        raise AttributeError("adapt's own mistake")
    except AttributeError as err:  # raised here, in the tests: not the model's software
        assert library_failure(model, err) is None


def _reference_model(zoo, name: str = "llama"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(zoo(name)), dtype=torch.float64).eval()


def _prefix_by_prefix(model, prompt: torch.Tensor, new_tokens: int):
    """The reference as it is defined: every step a forward over the whole prefix, no cache."""
    seq, steps = prompt.view(1, -1), []
    for _ in range(new_tokens):
        logits = model(input_ids=seq, use_cache=False).logits
        steps.append(logits[0, -1])
        seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)
    return seq[0], torch.stack(steps)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_reference_continuation_is_the_uncached_one(zoo, name):
    from validators.generation_steps import greedy_reference

    model = _reference_model(zoo, name)
    prompt = torch.randint(0, model.config.vocab_size, (int(torch.randint(3, 12, ())),))
    with torch.no_grad():
        ids, steps = greedy_reference(model, prompt, 16)
        want_ids, want_steps = _prefix_by_prefix(model, prompt, 16)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(steps, want_steps, rtol=1e-12, atol=1e-12)


def test_a_cache_that_decodes_differently_does_not_change_the_reference(zoo):
    """The cache only proposes the continuation: where its tokens differ from the uncached forward's, the reference
    recomputes from that step, prefix by prefix."""
    from validators.decode import cache_keyword
    from validators.generation_steps import _cached_greedy, greedy_reference

    model = _reference_model(zoo)
    vocab, decoding = model.config.vocab_size, {"cached": False}
    keyword = cache_keyword(model)
    model.register_forward_pre_hook(
        lambda module, args, kwargs: decoding.update(cached=kwargs.get(keyword) is not None), with_kwargs=True
    )
    favourite = int(torch.randint(0, vocab, ()))
    bias = 1e3 * torch.nn.functional.one_hot(torch.tensor(favourite), vocab).double()
    # decoding with the cache always says ``favourite``: a proposal the uncached forward refutes
    model.lm_head.register_forward_hook(lambda m, a, out: out + bias if decoding["cached"] else None)
    prompt = torch.randint(0, vocab, (7,))
    with torch.no_grad():
        proposal = _cached_greedy(model, prompt.view(1, -1), 10)
        ids, steps = greedy_reference(model, prompt, 10)
        decoding["cached"] = False
        want_ids, want_steps = _prefix_by_prefix(model, prompt, 10)
    assert bool((proposal[0, 8:] == favourite).all()) and not torch.equal(proposal[0], want_ids)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(steps, want_steps, rtol=1e-12, atol=1e-12)
