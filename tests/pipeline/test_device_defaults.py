"""Defaults chosen by the validation device, and typed results read back from a stored run."""

from __future__ import annotations

import dataclasses

import pytest
from pipeline_helpers import EXAMPLE, adapt_run, cli, load

from adapt.app.pipeline.options import (
    LOCAL_CLUSTER,
    DeviceDescription,
    RunOptions,
    choose_defaults,
    defaults_help,
    max_positions,
)
from adapt.core.errors import BadInput

CPU = DeviceDescription("cpu")
H200 = DeviceDescription("cuda", "NVIDIA H200", 1, 141 * 2**30)  # a GPU described, not present


@pytest.mark.parametrize(("positions", "seq"), [(32768, 2048), (2048, 2048), (1024, 1024), (None, 2048)])
def test_cuda_defaults_train_sized_shapes_on_this_machine(positions, seq):
    defaults = choose_defaults(H200, positions)
    assert defaults.seq_len == seq
    assert defaults.dtype == "bf16"
    assert defaults.cluster == LOCAL_CLUSTER
    cpu = choose_defaults(CPU, positions)
    assert defaults.bench_steps > cpu.bench_steps and defaults.soak_steps > cpu.soak_steps
    assert defaults.soak_steps % defaults.ckpt_every == 0


@pytest.mark.parametrize(("positions", "seq"), [(4096, 32), (16, 16), (None, 32)])
def test_cpu_defaults_stay_small_and_plan_for_a_gpu_node(positions, seq):
    defaults = choose_defaults(CPU, positions)
    assert (defaults.dtype, defaults.seq_len, defaults.batch_size) == ("fp32", seq, 2)
    assert (defaults.bench_steps, defaults.soak_steps, defaults.ckpt_every) == (3, 12, 4)
    assert defaults.cluster == "8xH100"


def test_given_options_win_and_the_device_fills_the_rest():
    options = RunOptions.from_dict({"source": "m", "out_dir": "o", "seq_len": 64, "cluster": "2xA100"})
    resolved = options.with_device_defaults(H200, 4096)
    validation = resolved.validation
    assert (validation.seq_len, resolved.plan.cluster) == (64, "2xA100")
    assert (validation.dtype, validation.batch_size, validation.soak_steps) == ("bf16", 2, 40)
    assert set(resolved.device_chosen) == {"dtype", "batch_size", "bench_steps", "soak_steps", "ckpt_every"}
    assert resolved.machine == H200.label() and "H200" in resolved.machine
    assert resolved.to_dict()["device_chosen"] == list(resolved.device_chosen)


def test_max_positions_reads_the_config_a_model_family_uses():
    assert max_positions({"max_position_embeddings": 4096}) == 4096
    assert max_positions({"n_positions": 1024}) == 1024
    assert max_positions({"text_config": {"max_position_embeddings": 8192}}) == 8192
    assert max_positions({"hidden_size": 64}) is None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_bad_input(tmp_path, capsys):
    with pytest.raises(BadInput):
        DeviceDescription.of("cuda")
    assert adapt_run(EXAMPLE, tmp_path / "run", "--device", "cuda", "--stages", "intake") == 2
    assert "Traceback" not in capsys.readouterr().err


def test_help_states_each_device_s_defaults(capsys):
    assert cli("run", "--help") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert " ".join(defaults_help().split()) in text
    for device in (CPU, H200):
        defaults = choose_defaults(device, None)
        assert f"seq min(max positions, {defaults.seq_len})" in text and f"--cluster {defaults.cluster}" in text


def test_a_cuda_run_records_what_its_device_chose(tmp_path, monkeypatch):
    """A fake CUDA description: the run's options (and the report header) carry the CUDA defaults."""
    monkeypatch.setattr(DeviceDescription, "of", classmethod(lambda cls, device: H200))
    out = tmp_path / "run"
    assert adapt_run(EXAMPLE, out, "--device", "cuda", "--stages", "intake", "--soak-steps", "8") == 0
    options = load(out)["options"]
    assert (options["dtype"], options["seq_len"], options["cluster"]) == ("bf16", 256, LOCAL_CLUSTER)  # 256 positions
    assert options["soak_steps"] == 8 and "soak_steps" not in options["device_chosen"]
    assert options["machine"] == H200.label()
    header = (out / "report.md").read_text()
    assert f"Defaults chosen by the device ({H200.label()})" in header and "seq_len 256" in header


def test_cached_typed_results_are_read_back_not_recomputed(tmp_path):
    """The environment stage reads the cached plan through PlannerResult.from_dict, not by re-planning."""
    out = tmp_path / "run"
    assert adapt_run(EXAMPLE, out, "--stages", "intake,plan") == 0
    assert adapt_run(EXAMPLE, out, "--stages", "intake,plan,environment") == 0
    stages = {s["name"]: s for s in load(out)["stages"]}
    assert stages["intake"]["cached"] and stages["plan"]["cached"] and not stages["environment"]["cached"]
    notes = stages["environment"]["summary"].get("notes", [])
    assert not any("re-ran the cached" in note for note in notes)
    assert stages["environment"]["summary"]["plan_target"] == "8xH100"
    assert stages["environment"]["summary"]["judged_against_plan"] is False


@pytest.fixture(scope="module")
def planned():
    """The example's ModelSpec and its plan for the CPU's default cluster."""
    from adapt.app.clusters import target_cluster
    from adapt.app.pipeline.stages import plan_workload
    from adapt.model.intake import build_spec, resolve_source
    from parallel_planner.search import plan_parallel

    spec = build_spec(resolve_source(str(EXAMPLE)))
    options = RunOptions.from_dict({"source": str(EXAMPLE), "out_dir": "o"}).with_device_defaults(CPU, 256)
    return spec, plan_parallel(spec, target_cluster(options.plan.cluster), plan_workload(options), top_k=3)


def test_stage_loaders_round_trip_their_results(planned):
    from adapt.app.pipeline.stages import STAGES
    from adapt.core.jsonio import to_jsonable

    spec, result = planned
    for name, typed in (("intake", spec), ("plan", result)):
        stored = to_jsonable(typed.to_dict())
        rebuilt = STAGES[name].load(stored)
        assert type(rebuilt) is type(typed) and to_jsonable(rebuilt.to_dict()) == stored
    assert dataclasses.asdict(STAGES["plan"].load(to_jsonable(result.to_dict())).best.plan) == dataclasses.asdict(
        result.best.plan
    )


@pytest.mark.parametrize(("cluster", "judged"), [(LOCAL_CLUSTER, True), ("8xH100", False)])
def test_environment_stage_judges_only_a_plan_for_this_machine(planned, tmp_path, cluster, judged):
    """The stage hands the plan's target to the validator: ``local`` is judged, a named remote cluster is not."""
    from adapt.app.pipeline.stages import STAGES, StageContext, plan_workload
    from parallel_planner.cluster import make_cluster
    from parallel_planner.search import plan_parallel

    spec, remote = planned
    options = RunOptions.from_dict({"source": str(EXAMPLE), "out_dir": "o", "cluster": cluster})
    options = options.with_device_defaults(CPU, 256)
    # a one-GPU plan stands in for the measured local machine, which this CPU cannot measure
    result = plan_parallel(spec, make_cluster("h200", 1), plan_workload(options)) if judged else remote
    ctx = StageContext(options, None, tmp_path, lambda *a: None, "key", None, lambda name: result)
    report = STAGES["environment"].execute(ctx)
    assert report.judged_against_plan is judged and report.plan_target == cluster
    assert report.passed == (not report.problems) and not any("GPU" in p for p in report.problems)
    assert bool(report.notes) is not judged
