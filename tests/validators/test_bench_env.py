"""Throughput and environment stages on the CPU; the calibration they emit loads in the planner."""

from __future__ import annotations

import json

import pytest

from adapt.model.intake import resolve_source
from parallel_planner.calibration import load_calibration
from parallel_planner.plan import ParallelPlan
from validators.environment import check_environment
from validators.throughput import BenchOptions, bench


@pytest.fixture(scope="module")
def llama_bench(zoo):
    src = resolve_source(str(zoo("llama")))
    return bench(
        src, device="cpu", options=BenchOptions(dtype="fp32", seq_len=32, batch=2, steps=2, warmup=1, decode_tokens=4)
    )


def test_bench_measures_both_variants(llama_bench):
    report = llama_bench
    assert report.passed
    assert [v.name for v in report.variants] == ["eager", "adapted"]
    for variant in report.variants:
        assert variant.train_tokens_per_s > 0 and variant.prefill_tokens_per_s > 0 and variant.decode_tokens_per_s > 0
        assert variant.decode_kv_cache
        assert 0 < variant.mfu < 1
        assert variant.peak_memory_bytes > 0
        assert len(variant.losses) == 3
    # Same weights, same data, no kernel plan: the trainer's loss trajectories agree exactly.
    assert report.variants[0].losses == report.variants[1].losses
    assert report.train_flops_per_token > 0 and report.peak_flops_basis
    json.dumps(report.to_dict())


def test_bench_calibration_is_the_planner_format(llama_bench, tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(llama_bench.calibration))
    cal = load_calibration(path)
    assert [b.index for b in cal.blocks] == [0, 1]
    assert all(b.forward_s > 0 and b.backward_s > 0 for b in cal.blocks)
    assert cal.seq_len == 32 and cal.micro_batch == 2 and cal.hidden_size == 64
    adapted = llama_bench.variants[-1]
    (run,) = cal.runs  # the adapted model's training step, as the planner reads a measured run
    assert run["tokens_per_s"] == adapted.train_tokens_per_s and run["step_time_s"] == adapted.train_step_s
    assert run["global_batch"] == 2 and run["seq_len"] == 32 and run["layout"]["mbs"] == 2
    assert run["peak_memory_gib"] == adapted.peak_memory_bytes / 2**30
    assert cal.dtype == "fp32" and cal.gemm_efficiency is None  # a CPU has no datasheet peak to be a share of


def test_bench_depth_truncated_at_real_width(zoo):
    src = resolve_source(str(zoo("deepseek_v3")))
    with pytest.raises(Exception, match="align without --streamed|--max-layers"):
        bench(src, options=BenchOptions(dtype="fp32", seq_len=16, steps=1, warmup=1, max_layers=9))
    src = resolve_source(str(zoo("qwen3")))
    report = bench(
        src, options=BenchOptions(dtype="fp32", seq_len=16, steps=1, warmup=1, decode_tokens=2, max_layers=1)
    )
    assert report.truncated and report.layers_measured == 1 and report.layers_total == 2
    assert len(report.calibration["blocks"]) == 1 and report.calibration["runs"] == []  # not the model's step


def test_environment_on_cpu_says_what_it_could_not_check():
    report = check_environment(precision="bf16", device="cpu")
    assert report.device_type == "cpu"
    assert report.versions["torch"] and report.versions["transformers"]
    assert report.copy_gbps > 0 and report.matmul_tflops > 0
    assert "all-reduce bandwidth" in report.unchecked
    assert report.passed == (not report.problems)


def test_environment_lists_problems():
    report = check_environment(ParallelPlan(tp=8), precision="fp8", device="cpu", measure=False)
    assert not report.passed
    assert any("fp8" in p for p in report.problems)
    assert any("needs 8 GPUs" in p for p in report.problems)


def test_cli_contract(zoo, capsys):
    from adapt.app.cli import main

    code = main(["align", str(zoo("qwen2")), "--dtype", "fp32", "--no-backward", "--seq", "8", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["passed"] and data["first_divergent"] is None
    assert {"name", "cosine", "rel_err", "max_abs", "err_ratio", "passed"} <= set(data["layers"][0])
    with pytest.raises(SystemExit) as exc:
        main(["align", str(zoo("qwen2")), "--dtype", "fp8"])
    assert exc.value.code == 2
    for argv in (
        ["align", "/no/such/dir"],
        ["align", str(zoo("qwen2")), "--seq", "1"],
        ["bench", str(zoo("qwen2")), "--steps", "0"],
        ["align", str(zoo("qwen2")), "--device", "tpu"],
        ["env", "--plan", "/no/plan.json"],
    ):
        assert main(argv) == 2, argv
    assert main(["env", "--json", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["device_type"] == "cpu"
