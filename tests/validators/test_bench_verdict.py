"""The throughput verdict against the best baseline, and the shapes chosen on CUDA, from given figures."""

from __future__ import annotations

from types import SimpleNamespace

from validators.throughput import (
    BenchOptions,
    VariantResult,
    best_baseline_ratios,
    cuda_shapes,
    decode_shape,
    judge,
)

CUDA_OPTIONS = BenchOptions(seq_len=2048, batch=4, steps=20)


def variant(
    name: str, train: float, prefill: float = 100.0, decode: float = 10.0, idle: float | None = 0.05, cv: float = 0.01
) -> VariantResult:
    return VariantResult(
        name,
        1.0,
        train,
        None,
        prefill,
        decode,
        True,
        1,
        [1.0],
        step_time_cv=cv,
        gpu_idle_share=idle,
        host_bound=idle is not None and idle > 0.3,
    )


def test_adapted_is_judged_against_the_best_baseline_part_by_part():
    runs = [
        variant("eager", 100.0, prefill=300.0),
        variant("compiled", 150.0, prefill=200.0),
        variant("adapted", 140.0, prefill=310.0),
    ]
    ratios = best_baseline_ratios(runs)
    assert ratios["train"] == ("compiled", 140.0 / 150.0) and ratios["prefill"] == ("eager", 310.0 / 300.0)
    verdict, reasons = judge(runs, "cuda", CUDA_OPTIONS)
    assert verdict == "failed" and "train x0.93 of compiled" in reasons[0] and "prefill" not in reasons[0]


def test_faster_than_every_baseline_passes_and_says_by_how_much():
    runs = [variant("eager", 100.0), variant("compiled", 150.0), variant("adapted", 180.0, prefill=120.0, decode=11.0)]
    verdict, reasons = judge(runs, "cuda", CUDA_OPTIONS)
    assert verdict == "passed" and "train x1.20 of compiled" in reasons[0]


def test_a_cpu_figure_is_inconclusive_and_a_host_bound_one_is_marked():
    runs = [variant("eager", 100.0, idle=None), variant("adapted", 200.0, idle=None)]
    verdict, reasons = judge(runs, "cpu", BenchOptions(seq_len=32, batch=2, steps=3))
    assert verdict == "inconclusive" and "2 x 32" in reasons[0]
    runs = [variant("eager", 100.0), variant("compiled", 100.0, idle=0.6), variant("adapted", 120.0)]
    verdict, reasons = judge(
        runs, "cuda", CUDA_OPTIONS
    )  # a host-bound baseline is what the user would get: said, judged
    assert verdict == "passed" and any("compiled is host-bound" in r and "60%" in r for r in reasons)
    runs = [variant("eager", 100.0), variant("compiled", 100.0), variant("adapted", 120.0, idle=0.5)]
    verdict, reasons = judge(runs, "cuda", CUDA_OPTIONS)
    assert verdict == "inconclusive" and any("adapted is host-bound" in r and "50%" in r for r in reasons)


def test_decode_is_judged_on_the_serving_paths_against_the_targets_when_they_were_timed(rng):
    runs = [
        variant("eager", 100.0, decode=300.0),
        variant("compiled", 120.0, decode=250.0),
        variant("adapted", 130.0, decode=280.0),  # slower than eager in the training loop: not judged
    ]
    static1, static8 = rng.uniform(200, 400), rng.uniform(1200, 1600)
    rows = [
        {"variant": v, "batch": b, "decode_tokens_per_s": r, "gpu_idle_share": 0.02 if v == "adapted" else None}
        for v, b, r in (
            ("hf-eager", 1, 40.0),
            ("hf-static-compile", 1, static1),
            ("adapted", 1, static1 * 1.19),
            ("hf-eager", 8, 290.0),
            ("hf-static-compile", 8, static8),
            ("adapted", 8, static8 * 0.95),
        )
    ]
    verdict, reasons = judge(runs, "cuda", CUDA_OPTIONS, rows)
    assert verdict == "failed" and "decode at batch 8: x0.95 of hf-static-compile (min x1): failed" in reasons[0]
    assert "decode at batch 1" not in reasons[0] and "decode x" not in reasons[0]
    rows[-1]["decode_tokens_per_s"] = static8 * 1.1
    verdict, reasons = judge(runs, "cuda", CUDA_OPTIONS, rows)
    assert verdict == "passed" and any("decode at batch 1: x1.19 of hf-static-compile" in r for r in reasons)
    rows[-1]["gpu_idle_share"] = 0.6  # a host-bound adapted decode: said, and judged like the paths it is compared to
    verdict, reasons = judge(runs, "cuda", CUDA_OPTIONS, rows)
    assert verdict == "passed" and any("batch 8" in r and "idle 60%" in r for r in reasons)
    del rows[1]  # HF static+compile at batch 1 not measured
    rows[-1]["gpu_idle_share"] = 0.0
    verdict, reasons = judge(runs, "cuda", CUDA_OPTIONS, rows)
    assert verdict == "inconclusive" and any("hf-static-compile not measured" in r for r in reasons)


def test_decode_prompt_is_shortened_to_the_model_positions(rng):
    notes: list[str] = []
    assert decode_shape(BenchOptions(), 131072, notes) == (512, 256) and not notes
    positions = rng.randint(300, 700)
    prompt, new_tokens = decode_shape(BenchOptions(), positions, notes)
    assert prompt + new_tokens == positions and new_tokens == 256 and str(positions) in notes[0]


def test_cuda_shapes_fill_a_fraction_of_free_memory():
    spec = SimpleNamespace(
        max_position_embeddings=131072, params_total=1_000_000_000, num_layers=16, hidden_size=2048, vocab_size=128256
    )
    seq, batch, how = cuda_shapes(spec, 140 * 2**30, 2, 0.6)
    assert seq == 2048 and "60% of 140 GiB" in how
    per_token = 16 * 34 * 2048 + 3 * 4 * 128256
    used = 1e9 * 12 + batch * seq * per_token
    assert used <= 0.6 * 140 * 2**30 < 1e9 * 12 + (batch + 1) * seq * per_token
    short = SimpleNamespace(
        max_position_embeddings=512, params_total=10**6, num_layers=2, hidden_size=64, vocab_size=256
    )
    assert cuda_shapes(short, 10 * 2**30, 2, 0.6)[:2] == (512, 64)  # capped at 64 sequences
    assert cuda_shapes(spec, 2 * 2**30, 2, 0.6)[1] == 1  # weights alone exceed the share: one sequence
