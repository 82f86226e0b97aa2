"""Run knobs (SP, TP overlap, gradient overlap, network), host-bound layouts, refusals and calibration."""

from __future__ import annotations

import dataclasses

import pytest

from adapt.core.errors import BadInput
from parallel_planner.calibration import calibration_from_dict
from parallel_planner.cluster import make_cluster
from parallel_planner.efficiency import Efficiency
from parallel_planner.published import load_published_runs, run_spec
from parallel_planner.search import plan_parallel
from parallel_planner.workload import Workload
from tests.planner.specs import decoder_spec

BASE = dict(pp=1, cp=1, zero=1, recompute="none", mbs=1, split="balanced")


def _plan(spec, gpus=8, eff=None, batch=64, seq=2048, **knobs):
    return plan_parallel(
        spec, make_cluster("h100", gpus), Workload(seq, batch), fixed={**BASE, **knobs}, top_k=1, efficiency=eff
    ).best


def test_sequence_parallel_and_tp_overlap_change_memory_and_exposed_comm():
    spec = decoder_spec(layers=8, hidden=4096, ffn=11008, heads=32, kv_heads=8)
    megatron = Efficiency(runtime="megatron")  # hand-written TP: the GPU, not DTensor's dispatch, sets the pace
    on = _plan(spec, tp=8, dp=1, sp=1, tp_overlap=0, eff=megatron, seq=8192, batch=16, mbs=4)
    off = _plan(spec, tp=8, dp=1, sp=0, tp_overlap=0, eff=megatron, seq=8192, batch=16, mbs=4)
    assert not on.host_bound
    assert off.memory_breakdown["activations"] > on.memory_breakdown["activations"]
    assert off.step_time_s > on.step_time_s  # norms and residuals on the whole activation
    overlapped = _plan(spec, tp=8, dp=1, sp=1, tp_overlap=1, eff=megatron, seq=8192, batch=16, mbs=4)
    assert overlapped.time_breakdown["exposed_comm_per_microbatch"] < on.time_breakdown["exposed_comm_per_microbatch"]
    assert overlapped.step_time_s < on.step_time_s


def test_gradient_reduction_after_the_flush_is_exposed():
    spec = decoder_spec()
    overlapped = _plan(spec, tp=1, dp=8, grad_overlap=1, zero=0)
    flushed = _plan(spec, tp=1, dp=8, grad_overlap=0, zero=0)
    assert flushed.time_breakdown["data_parallel_exposed"] > overlapped.time_breakdown["data_parallel_exposed"]


def test_network_bandwidth_is_a_fixed_knob():
    spec = decoder_spec()
    fast = _plan(spec, gpus=16, tp=1, dp=16, zero=3)
    slow = _plan(spec, gpus=16, tp=1, dp=16, zero=3, inter_gbps=1)
    assert slow.step_time_s > fast.step_time_s
    with pytest.raises(BadInput, match="inter_gbps"):
        _plan(spec, gpus=16, tp=1, dp=16, inter_gbps=-1)


def test_dtensor_tensor_parallelism_on_a_small_model_is_host_bound():
    spec = decoder_spec(layers=8, hidden=512, ffn=1408, heads=8, kv_heads=4)
    eager = Efficiency(fused_kernels=False)
    tp = _plan(spec, gpus=2, tp=2, dp=1, sp=1, eff=eager, batch=8)
    assert tp.host_bound and tp.time_breakdown["host_per_microbatch"] > tp.time_breakdown["gpu_per_microbatch"]
    compiled = _plan(spec, gpus=2, tp=2, dp=1, sp=1, eff=dataclasses.replace(eager, compiled=True), batch=8)
    assert compiled.step_time_s < tp.step_time_s
    big = _plan(
        decoder_spec(layers=8, hidden=8192, ffn=28672, heads=64, kv_heads=8),
        tp=8,
        dp=1,
        sp=1,
        eff=eager,
        batch=8,
        seq=8192,
        mbs=4,
    )
    assert not big.host_bound


def test_bloom_light_ends_is_evaluated_and_refusals_name_the_knob():
    bloom = next(r for r in load_published_runs() if r.source == "bloom")
    spec, cluster = run_spec(bloom), make_cluster("a100", 384)
    fixed = dict(tp=4, pp=12, dp=8, cp=1, zero=1, recompute="full", mbs=2, schedule="1f1b", split="light_ends")
    best = plan_parallel(spec, cluster, bloom.workload(), fixed=fixed, top_k=1).best
    assert best.plan.stage_layers[0] == best.plan.stage_layers[-1] == 5 and sum(best.plan.stage_layers) == 70
    with pytest.raises(BadInput, match="releasing schedule=interleaved_1f1b would admit one"):
        plan_parallel(spec, cluster, bloom.workload(), fixed=dict(fixed, schedule="interleaved_1f1b"), top_k=1)
    # Pinning virtual stages as well leaves no single knob to release: the reason names the pinned ones.
    with pytest.raises(BadInput, match=r"vpp/schedule: .*multiple of pp=12"):
        plan_parallel(spec, cluster, bloom.workload(), fixed=dict(fixed, schedule="interleaved_1f1b", vpp=2), top_k=1)


def test_calibration_runs_and_gemm_efficiency_move_the_prediction():
    spec = decoder_spec(layers=8, hidden=2048, ffn=5632, heads=16, kv_heads=8)
    layout = dict(tp=1, pp=1, dp=1, cp=1, zero=1, recompute="none", mbs=4)
    before = plan_parallel(spec, make_cluster("h200", 1), Workload(2048, 4), fixed=layout, top_k=1).best
    measured = before.tokens_per_s * 0.7  # a measurement 30 % slower than predicted
    cal = calibration_from_dict(
        {
            "device": "NVIDIA H200",
            "runs": [{"gpus": 1, "layout": layout, "seq_len": 2048, "global_batch": 4, "tokens_per_s": measured}],
        }
    )
    after = plan_parallel(spec, make_cluster("h200", 1), Workload(2048, 4), fixed=layout, top_k=1, calibration=cal).best
    assert after.tokens_per_s == pytest.approx(measured, rel=1e-3)
    faster = calibration_from_dict({"device": "NVIDIA H200", "gemm_efficiency": 0.95})
    quick = plan_parallel(spec, make_cluster("h200", 1), Workload(2048, 4), fixed=layout, top_k=1, calibration=faster)
    assert quick.best.step_time_s < before.step_time_s
    with pytest.raises(BadInput, match="no blocks, runs"):
        calibration_from_dict({"device": "x"})


def test_throughput_measurements_replan_through_the_cli(spec_json, tmp_path, capsys):
    import json

    from adapt.app.cli import main
    from adapt.core.spec import ModelSpec
    from parallel_planner.calibration import calibration_from_measurements
    from parallel_planner.replan import replan_with_measurements

    spec = ModelSpec.from_dict(json.loads(spec_json.read_text()))
    layout = dict(tp=1, pp=1, dp=1, cp=1, zero=1, recompute="none", mbs=4)
    cluster, workload = make_cluster("h200", 1), Workload(2048, 4)
    before = plan_parallel(spec, cluster, workload, fixed=layout, top_k=1).best
    measured = calibration_from_measurements(
        "NVIDIA H200",
        gemm_tflops=600.0,
        peak_tflops=989.0,
        dispatch={"eager_s": 3e-5, "dtensor_s": 9e-5},
        runs=[
            {
                "gpus": 1,
                "layout": layout,
                "seq_len": 2048,
                "global_batch": 4,
                "tokens_per_s": before.tokens_per_s / 2,
                "peak_memory_gib": 30.0,
            }
        ],
    )
    after = replan_with_measurements(spec, cluster, workload, measured, fixed=layout, top_k=1)
    assert after.best.tokens_per_s == pytest.approx(before.tokens_per_s / 2, rel=1e-3)
    assert after.efficiency["host"]["eager_s"] == 3e-5
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(measured))
    assert (
        main(
            [
                "plan",
                str(spec_json),
                "--gpu",
                "h200",
                "--gpus",
                "1",
                "--seq",
                "2048",
                "--global-batch",
                "4",
                "--fixed",
                "tp=1,pp=1,dp=1,cp=1,zero=1,recompute=none,mbs=4",
                "--calibration",
                str(path),
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["plans"][0]["tokens_per_s"] == pytest.approx(after.best.tokens_per_s, rel=1e-9)
    path.write_text(json.dumps({**measured, "runs": [{"gpus": 1, "tokens_per_s": -1}]}))
    assert (
        main(
            [
                "plan",
                str(spec_json),
                "--gpu",
                "h200",
                "--gpus",
                "1",
                "--seq",
                "2048",
                "--global-batch",
                "4",
                "--calibration",
                str(path),
            ]
        )
        == 2
    )
    assert "calibration" in capsys.readouterr().err


def test_cli_software_flags_reach_the_time_model(spec_json, capsys):
    import json

    from adapt.app.cli import main

    argv = [
        "plan",
        str(spec_json),
        "--gpu",
        "h200",
        "--gpus",
        "2",
        "--seq",
        "2048",
        "--global-batch",
        "8",
        "--fixed",
        "tp=2,pp=1,dp=1,cp=1,zero=1,recompute=none,mbs=4",
        "--json",
    ]
    times = {}
    for flags in ([], ["--kernels", "eager"], ["--runtime", "megatron"], ["--compiled"]):
        assert main(argv + flags) == 0
        data = json.loads(capsys.readouterr().out)
        times[" ".join(flags)] = data["plans"][0]["step_time_s"]
        assert data["efficiency"]["fused_kernels"] == ("eager" not in flags)
    assert times["--kernels eager"] > times[""]  # more HBM passes and more operators to issue
    assert times["--runtime megatron"] < times[""] and times["--compiled"] < times[""]  # no DTensor dispatch
