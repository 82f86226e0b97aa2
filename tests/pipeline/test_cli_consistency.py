"""One flag name and one default per quantity, the same --cluster forms, and --json on every command."""

from __future__ import annotations

import json

import pytest
from pipeline_helpers import EXAMPLE, cli, leaf_commands

from adapt.app.cli import build_parser
from adapt.app.pipeline.options import PLAN_GLOBAL_BATCH, PLAN_SEQ_LEN


def test_every_command_has_json():
    missing = [name for name, parser in leaf_commands().items() if "--json" not in parser._option_string_actions]
    assert not missing


def test_one_spelling_and_default_per_quantity():
    for name in ("run", "align", "bench", "soak"):
        parser = leaf_commands()[name]
        for flag in ("--seq-len", "--batch-size"):  # unset: the device chooses, the same way for every command
            assert parser._option_string_actions[flag].default is None, (name, flag)
    for name in ("run", "plan"):
        parser = leaf_commands()[name]
        assert parser._option_string_actions["--plan-seq-len"].default == PLAN_SEQ_LEN
        assert "--cluster" in parser._option_string_actions
    assert leaf_commands()["run"]._option_string_actions["--global-batch"].default == PLAN_GLOBAL_BATCH
    # old spellings still parse, into the same quantity
    args = build_parser("align").parse_args(["align", "x", "--seq", "8", "--batch", "3"])
    assert (args.seq_len, args.batch_size) == (8, 3)
    args = build_parser("plan").parse_args(["plan", "x", "--seq", "1024"])
    assert args.plan_seq_len == 1024


def test_plan_runs_on_the_same_defaults_as_run(capsys):
    assert cli("plan", str(EXAMPLE), "--json") == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["cluster"]["num_gpus"] == 8 and answer["cluster"]["gpu"]["name"] == "h100"
    assert cli("plan", str(EXAMPLE), "--cluster", "16xa100", "--json") == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["num_gpus"] == 16


def test_run_json_prints_the_report(tmp_path, capsys):
    assert cli("run", str(EXAMPLE), "--stages", "intake", "--out", str(tmp_path / "r"), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads((tmp_path / "r" / "report.json").read_text())


def test_report_and_launch_json(tmp_path, capsys):
    run = tmp_path / "r"
    assert cli("run", str(EXAMPLE), "--stages", "intake,plan", "--out", str(run), "--quiet") == 0
    assert cli("report", "render", str(run), "--json") == 0
    written = json.loads(capsys.readouterr().out)["written"]
    assert set(written) == {"md", "html", "junit"}
    assert cli("launch", str(EXAMPLE), "--plan", str(run / "plan.json"), "--json") == 0
    launch = json.loads(capsys.readouterr().out)
    assert launch["command"][-2:] == ["--plan", str(run / "plan.json")] or str(run / "plan.json") in launch["command"]


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "x", "--top", "0"],
        ["plan", "x", "--gpu-memory-utilization", "1.5"],
        ["run", "x", "--stages", "soak"],
    ],
)
def test_input_errors_are_one_line(argv, capsys):
    assert cli(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("adapt: error:")


def test_options_are_judged_whatever_stages_run_and_an_unwritable_out_is_bad_input(capsys, tmp_path):
    """A wrong --profile must not pass because the operators stage was not selected; --out under a file is
    the user's input, not an internal error."""
    assert cli("run", str(EXAMPLE), "--stages", "intake", "--profile", "no-such-profile", "--out", str(tmp_path)) == 2
    assert "unknown profile 'no-such-profile'" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli("run", str(EXAMPLE), "--stages", "intake", "--out", str(blocker / "run")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write there" in err[0]


@pytest.mark.parametrize("command", ["run", "align"])
def test_a_sequence_past_the_models_positions_is_bad_input(command, capsys, tmp_path):
    """The example allows 256 positions; asking for more would index past a position table or run out of memory."""
    extra = ["--out", str(tmp_path)] if command == "run" else []
    assert cli(command, str(EXAMPLE), "--seq-len", "100000", *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["adapt: error: --seq-len is 100000; allowed: 1 to 256, the model's maximum positions"]
