"""``benchmarks/inference.py``: its scheduler's budget, the decode targets' verdicts and the files it writes."""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_inference", Path(__file__).parents[2] / "benchmarks" / "inference.py"
)
bench = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = bench  # its dataclasses look their module up there
SPEC.loader.exec_module(bench)


def timing(variant: str, batch: int, rate: float, rng: random.Random, steps: int = 8) -> dict:
    tokens = [[rng.randrange(256) for _ in range(steps)] for _ in range(batch)]
    return {"variant": variant, "batch": batch, "decode_tokens_per_s": rate, "prefill_s": rng.uniform(0.01, 0.1),
            "gpu_idle_share": 0.03 if variant == "adapted" else None, "tokens": tokens}  # fmt: skip


def finished(shape: str, variant: str, **result) -> bench.Job:
    job = next(j for j in bench.jobs_for((shape,)) if j.variant == variant)
    job.state, job.result = "done", result
    return job


def test_files_carry_rates_ratios_verdicts_and_what_was_not_measured(tmp_path, rng):
    static = {b: rng.uniform(100, 1000) * b for b in (1, 2)}
    rows = {v: [] for v in bench.DECODE_VARIANTS}
    for b in (1, 2):
        rows["hf-static-compile"].append(timing("hf-static-compile", b, static[b], rng))
        rows["hf-eager"].append(timing("hf-eager", b, static[b] / 4, rng))
        rows["adapted"].append(timing("adapted", b, static[b] * (1.2 if b == 1 else 0.8), rng))
    rows["adapted"][0]["tokens"] = [list(r) for r in rows["hf-eager"][0]["tokens"]]
    rows["adapted"][0]["tokens"][0][5] += 1  # the first difference from eager at step 5
    generation = {"verdict": "passed", "new_tokens": 64, "summary": "3 prompts x 64 tokens",
                  "checks": [{"name": "tokens", "passed": True}]}  # fmt: skip
    jobs = [finished("llama-1b", v, rows=r) for v, r in rows.items()]
    jobs += [finished("llama-1b", "generation", **generation)]
    jobs += [finished("gemma2-2b", "hf-eager", error="not run: it did not fit the time budget")]
    results = {"sizes": bench.sizes(True), "budget_s": 100.0, "parallel": 2, "targets": bench.DECODE_TARGETS,
               "environment": {"torch": "t", "transformers": "x", "device": "NVIDIA H200"}}  # fmt: skip
    bench.collect(results, jobs, 42.0)
    bench.write(tmp_path, "inference-h200", results)
    data = json.loads((tmp_path / "inference-h200.json").read_text())
    targets = data["shapes"]["llama-1b"]["targets"]
    assert [(t["batch"], t["verdict"]) for t in targets] == [(1, "passed"), (2, "failed")]
    assert targets[1]["static_compile_verdict"] == "failed" and targets[1]["eager_verdict"] == "passed"  # 3.2x
    assert targets[0]["vs_eager"] == pytest.approx(4 * 1.2)
    assert all("tokens" not in r for r in data["shapes"]["llama-1b"]["adapted"]["rows"])
    agreement = {(a["batch"], a["against"]): a["identical_steps"] for a in data["shapes"]["llama-1b"]["agreement"]}
    assert agreement[(1, "hf-eager")] == 5
    assert data["shapes"]["gemma2-2b"]["targets"] == []
    table = (tmp_path / "inference-h200.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| llama-1b | 2 |"))
    assert "| 0.80x | 3.20x | failed |" in row
    assert "| gemma2-2b | 1 | not measured | not measured | not measured | - | - | inconclusive |" in table
    assert "x0.80 of hf-static-compile (min x1): failed" in table
    assert "greedy tokens identical to the reference over 64 new tokens (target >= 64" in table and ": met;" in table
    assert "gemma2-2b hf-eager: not run: it did not fit the time budget" in table


def test_too_short_a_generation_does_not_meet_the_target():
    gen = {"verdict": "passed", "new_tokens": 8, "summary": "", "checks": [{"name": "tokens", "passed": True}]}
    assert "NOT met" in bench.generation_line(gen)
    assert bench.generation_line({"error": "exit 1: boom"}) == "not measured: exit 1: boom"


def test_what_cannot_fit_the_budget_is_skipped_without_starting(tmp_path):
    args = argparse.Namespace(tiny=False, parallel=4)
    jobs = bench.jobs_for(("llama-1b", "gemma2-2b"))
    started = time.perf_counter()
    bench.Scheduler(jobs, args, tmp_path, time.perf_counter() + 20.0).run(lambda: None)
    assert time.perf_counter() - started < 5  # skipped at once, not waited out
    assert {j.state for j in jobs} == {"skipped"} and all(j.proc is None for j in jobs)
    assert all("time budget" in j.result["error"] or "did not complete" in j.result["error"] for j in jobs)


def test_every_shape_runs_every_step_after_what_it_needs():
    jobs = bench.jobs_for(("llama-1b", "gemma2-2b"))
    for shape in ("llama-1b", "gemma2-2b"):
        mine = {j.variant: j for j in jobs if j.shape == shape}
        assert set(mine) == {"build", "plan", "generation", *bench.DECODE_VARIANTS}
        order = [j.variant for j in jobs if j.shape == shape]
        for job in mine.values():
            assert all(order.index(need) < order.index(job.variant) for need in job.needs)
    assert bench.sizes(False) | {} == {**bench.sizes(False)} and bench.sizes(False)["batches"] == (1, 8)
    assert (bench.sizes(False)["prompt"], bench.sizes(False)["new_tokens"], bench.sizes(False)["gen_tokens"]) == (
        512, 256, 64)  # fmt: skip


def test_one_kernel_plan_at_a_time():
    jobs = bench.jobs_for(("llama-1b", "gemma2-2b"))
    scheduler = bench.Scheduler(jobs, argparse.Namespace(tiny=False, parallel=4), Path("."), time.perf_counter())
    plans = [j for j in jobs if j.variant == "plan"]
    assert not scheduler._other_plan_works(plans[1])
    plans[0].state = "working"
    assert scheduler._other_plan_works(plans[1]) and not scheduler._other_plan_works(jobs[-1])
