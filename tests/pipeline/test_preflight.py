"""Input checks that run before any stage: cluster files and forms, stage selection, the plan's sequence length."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from pipeline_helpers import EXAMPLE, cli

from adapt.app.pipeline.options import PlanOptions
from adapt.app.pipeline.preflight import check_stage_selection, plan_seq_len_notes
from adapt.core.errors import BadInput
from parallel_planner.cluster import parse_cluster_option

GOOD = "gpu: h100\ngpus: 16\n"


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("gpu: h100\ngpus: 16\noverrides:\n  memory_gib: lots\n", ["overrides.memory_gib", "'lots'", "number > 0"]),
        ("gpu: h100\ngpus: 16\noverrides:\n  memory_gib: -80\n", ["overrides.memory_gib", "-80", "number > 0"]),
        ("gpu: h100\ngpus: 16\noverrides:\n  bf16_tflops: 0\n", ["overrides.bf16_tflops", "0", "number > 0"]),
        ("gpu: h100\ngpus: 8.7\n", ["gpus is 8.7", "integer >= 1"]),
        ("gpu: h100\ngpus: 16\ngpus_per_node: 0\n", ["gpus_per_node is 0", "integer >= 1"]),
        ("gpu: h100\ngpus: true\n", ["gpus is True", "integer >= 1"]),
        ("gpu: h100\ngpus: 16\noverrides:\n  gemm_ceiling: 1.5\n", ["gemm_ceiling is 1.5", "(0, 1]"]),
        ("gpu: h100\ngpus: 16\nnodes: 2\n", ["unknown key 'nodes'", "allowed"]),
        ("gpu: 5\ngpus: 16\n", ["gpu is 5", "catalogue name"]),
        ("gpu: h100\ngpus: 16\noverrides: [1]\n", ["overrides is [1]", "mapping"]),
    ],
)
def test_bad_cluster_files_name_field_value_and_what_is_allowed(tmp_path, capsys, text, fragments):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    for argv in (["plan", str(EXAMPLE), "--cluster", str(path)], ["run", str(EXAMPLE), "--cluster", str(path),
                                                                  "--out", str(tmp_path / "out")]):  # fmt: skip
        start = time.perf_counter()
        assert cli(*argv) == 2
        assert time.perf_counter() - start < 10  # no stage ran (a stage takes tens of seconds here)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        for fragment in fragments:
            assert fragment in err[0], (fragment, err[0])
    assert not (tmp_path / "out" / "stages").exists()
    assert path.read_text() == text


def test_cluster_forms_are_the_same_for_run_and_plan(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('gpus = 16\ngpu = "a100"\n')
    assert parse_cluster_option(str(path)).num_gpus == 16
    assert parse_cluster_option("16xA100").gpu.name == "a100"
    assert parse_cluster_option("local") is None  # measured when the work starts
    for bad in ("0xH100", "8xFOO", "eight", ""):
        with pytest.raises(BadInput, match="--cluster"):
            parse_cluster_option(bad)


@pytest.mark.parametrize("argv", [["--gpus", "0", "--gpu", "h100"], ["--gpu", "h100", "--gpus", "-3"]])
def test_plan_names_a_bad_gpu_count(capsys, argv):
    assert cli("plan", str(EXAMPLE), *argv) == 2
    err = capsys.readouterr().err
    assert "--gpus is" in err and "integer >= 1" in err and "say where" not in err


def test_a_selection_missing_what_a_stage_needs_is_bad_input():
    check_stage_selection(["intake", "plan"])
    check_stage_selection(["operators", "soak"])
    with pytest.raises(BadInput, match=r"--stages soak: soak needs the operators stage.*--stages operators,soak"):
        check_stage_selection(["soak"])
    with pytest.raises(BadInput, match="plan needs the intake stage"):
        check_stage_selection(["plan"])


def test_plan_sequence_length_is_capped_at_the_models_positions():
    options = PlanOptions(plan_seq_len=4096)
    notes = plan_seq_len_notes(options, SimpleNamespace(config_dict={"max_position_embeddings": 256}))
    assert options.plan_seq_len == 256
    expected = "plan sequence length capped at 256, the model's max_position_embeddings (--plan-seq-len asked for 4096)"
    assert notes == [expected]
    options = PlanOptions(plan_seq_len=128)
    assert plan_seq_len_notes(options, SimpleNamespace(config_dict={"max_position_embeddings": 256})) == []
    assert options.plan_seq_len == 128


def test_stages_report_alone_is_refused_up_front(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli("run", str(EXAMPLE), "--out", str(out), "--stages", "report", "--quiet") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("adapt: error: --stages report alone") and not out.exists()


def test_a_stage_refusing_its_input_says_so_in_one_line_even_when_quiet(tmp_path, capsys):
    """3 GPUs cannot lay out a global batch of 64: the plan stage refuses, the run exits 2 with its reason."""
    out = tmp_path / "out"
    assert cli("run", str(EXAMPLE), "--out", str(out), "--stages", "intake,plan", "--cluster", "3xh200", "--quiet") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("adapt: error: plan: no valid layout for 3 x h200")
    assert (out / "report.json").is_file()  # the stages that ran keep their results
