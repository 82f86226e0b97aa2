"""The calibration loop: the throughput stage's file round-trips, the re-plan meets the measurement, and
fixed layouts that exist are evaluated while impossible ones are refused naming the knob."""

from __future__ import annotations

import json

import pytest

from adapt.core.errors import BadInput
from parallel_planner.calibration import calibration_from_measurements, load_calibration
from parallel_planner.cluster import make_cluster
from parallel_planner.published import load_published_runs, run_spec
from parallel_planner.replan import CalibratedPlan, replan
from parallel_planner.search import plan_parallel
from parallel_planner.workload import Workload
from tests.planner.specs import decoder_spec

SPEC = decoder_spec(layers=8, hidden=2048, ffn=5632, heads=16, kv_heads=8)


def _bench_run(batch: int, seq: int, tokens_per_s: float, peak_gib: float) -> dict:
    """A run as the throughput stage writes it: the trainer's one-rank layout."""
    layout = {"tp": 1, "pp": 1, "cp": 1, "zero": 0, "recompute": "none", "mbs": batch}
    return {
        "gpus": 1,
        "layout": layout,
        "seq_len": seq,
        "global_batch": batch,
        "tokens_per_s": tokens_per_s,
        "step_time_s": batch * seq / tokens_per_s,
        "peak_memory_gib": peak_gib,
        "mfu": 0.3,
    }


def _measured_prediction(batch: int, seq: int) -> float:
    """The uncalibrated model's tokens/s for the bench's own layout on one H200."""
    fixed = dict(tp=1, pp=1, dp=1, cp=1, zero=0, recompute="none", mbs=batch)
    return plan_parallel(SPEC, make_cluster("h200", 1), Workload(seq, batch), fixed=fixed, top_k=1).best.tokens_per_s


def test_calibration_file_round_trips(tmp_path, rng):
    batch, seq = rng.choice([2, 3, 6]), rng.choice([512, 1024, 2048])
    run = _bench_run(batch, seq, rng.uniform(1e4, 9e4), rng.uniform(10, 60))
    blocks = [
        {"index": i, "forward_s": rng.uniform(1e-4, 1e-2), "backward_s": rng.uniform(1e-4, 2e-2)} for i in range(8)
    ]
    achieved = rng.uniform(500, 800)
    shape = {"seq_len": seq, "micro_batch": batch, "hidden_size": 2048, "tokens": batch * seq}
    data = calibration_from_measurements("NVIDIA H200", achieved, 989.0, None, [run], shape=shape, blocks=blocks)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    cal = load_calibration(path)
    assert cal.device == "NVIDIA H200" and cal.dtype == "bf16"
    assert cal.gemm_efficiency == pytest.approx(achieved / 989.0)
    assert (cal.seq_len, cal.micro_batch, cal.hidden_size, cal.tokens) == (seq, batch, 2048, batch * seq)
    assert [b.forward_s for b in cal.blocks] == [b["forward_s"] for b in blocks]
    assert cal.runs[0]["tokens_per_s"] == run["tokens_per_s"]
    assert cal.runs[0]["peak_memory_gib"] == run["peak_memory_gib"]  # reported, kept beside the prediction
    assert cal.runs[0]["step_time_s"] == pytest.approx(batch * seq / run["tokens_per_s"])
    for bad in ({**data, "schema_version": 2}, {**data, "gemm_efficiency": 1.5}, [data]):
        path.write_text(json.dumps(bad))
        with pytest.raises(BadInput, match="calibration"):
            load_calibration(path)


def test_plan_reads_a_bad_calibration_file_as_bad_input(spec_json, tmp_path, capsys):
    from adapt.app.cli import main

    path = tmp_path / "calibration.json"
    for content in ("{not json", json.dumps({"schema": "something else", "device": "x", "gemm_efficiency": 0.5})):
        path.write_text(content)
        argv = ["plan", str(spec_json), "--gpu", "h200", "--gpus", "8", "--seq", "2048", "--calibration", str(path)]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "calibration" in err


def test_replan_meets_the_measured_step_and_keeps_both_plans(rng):
    batch, seq = rng.choice([2, 4, 6]), 2048
    slower = rng.uniform(0.4, 0.8)  # the machine runs slower than the physical model assumes
    measured = _measured_prediction(batch, seq) * slower
    before = plan_parallel(SPEC, make_cluster("h200", 8), Workload(seq, 64), top_k=3)
    run = _bench_run(batch, seq, measured, 40.0)
    calibration = calibration_from_measurements("NVIDIA H200", None, None, None, [run])
    result = replan(SPEC, before, calibration, top_k=3)
    assert result.applied and result.device == "NVIDIA H200" and result.target == "h200"
    (row,) = result.measured_runs
    assert row["after_tokens_per_s"] == pytest.approx(measured, rel=1e-3)
    assert abs(row["after_tokens_per_s"] - measured) < abs(row["before_tokens_per_s"] - measured)
    assert row["measured_peak_memory_gib"] == 40.0 and row["predicted_memory_gib"] > 0
    assert result.before["tokens_per_s"] == before.best.tokens_per_s
    assert result.after["tokens_per_s"] < result.before["tokens_per_s"]  # the slower machine moves the plan too
    assert result.changes[0].startswith("layout") and any(c.startswith("tokens_per_s ") for c in result.changes)
    again = CalibratedPlan.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again.after == result.after and again.result.best.tokens_per_s == result.result.best.tokens_per_s


@pytest.mark.parametrize(
    "device, dtype, reason",
    [("CPU x86_64 x2 threads", "fp32", "not the H200"), ("NVIDIA A100-SXM4-80GB", "bf16", "not the H200"),
     ("NVIDIA H200", "fp32", "16-bit")],
)  # fmt: skip
def test_a_measurement_of_another_machine_leaves_the_plan(device, dtype, reason):
    before = plan_parallel(SPEC, make_cluster("h200", 8), Workload(2048, 64), top_k=1)
    calibration = calibration_from_measurements(device, None, None, None, [_bench_run(2, 2048, 1e4, 5.0)], dtype=dtype)
    result = replan(SPEC, before, calibration)
    assert not result.applied and reason in result.reason and result.after is None
    assert replan(SPEC, before, None).reason.startswith("nothing measured")


def test_pinned_layouts_that_exist_are_evaluated_and_impossible_ones_name_the_knob():
    bloom = next(r for r in load_published_runs() if r.source == "bloom")
    spec, cluster = run_spec(bloom), make_cluster("a100", 384)
    # 70 layers over 12 stages: light_ends and balanced give the same split, and the pinned one is still evaluated
    best = plan_parallel(spec, cluster, bloom.workload(), fixed="pp=12,split=light_ends", top_k=1).best
    assert best.plan.stage_layers == [5] + [6] * 10 + [5]
    with pytest.raises(BadInput, match=r": releasing mbs=3 would admit one \(mbs=3 must divide"):
        plan_parallel(spec, cluster, bloom.workload(), fixed="pp=12,mbs=3,recompute=full", top_k=1)
    # 2048 sequences never divide over 24 ranks, and ZeRO-0 cannot offload: no single release is enough
    with pytest.raises(BadInput, match=r": dp=24 admits no layout even alone"):
        plan_parallel(spec, cluster, bloom.workload(), fixed="dp=24,zero=0,offload=1", top_k=1)
    small = decoder_spec()
    # a micro-batch the open search does not try is evaluated when pinned, and one that cannot divide is named
    three = plan_parallel(small, make_cluster("h100", 8), Workload(2048, 48), fixed="tp=1,pp=1,dp=8,mbs=3", top_k=1)
    assert three.best.plan.micro_batch == 3 and three.best.plan.grad_accum == 2
    with pytest.raises(BadInput, match="releasing mbs=5 would admit one"):
        plan_parallel(small, make_cluster("h100", 8), Workload(2048, 48), fixed="tp=1,pp=1,dp=8,mbs=5", top_k=1)
    with pytest.raises(BadInput, match="ep=2: the model has no routed experts to shard"):  # a dense model
        plan_parallel(small, make_cluster("h100", 8), Workload(2048, 48), fixed="ep=2", top_k=1)


def test_bloom_light_ends_through_the_cli(tmp_path, capsys):
    from adapt.app.cli import main

    bloom = next(r for r in load_published_runs() if r.source == "bloom")
    path = tmp_path / "bloom.json"
    path.write_text(run_spec(bloom).to_json())
    argv = ["plan", str(path), "--gpu", "a100", "--gpus", "384", "--seq", "2048", "--global-batch", "2048"]
    assert main([*argv, "--fixed", "tp=4,pp=12,dp=8,split=light_ends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fixed"]["split"] == "light_ends" and data["plans"][0]["plan"]["stage_layers"][0] == 5
    assert main([*argv, "--fixed", "tp=3,pp=12"]) == 2
    assert "tp=3" in capsys.readouterr().err
