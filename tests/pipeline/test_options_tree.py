"""The options tree: every command takes a quantity under its one flag and default, and the tree survives
a trip through the command line and through report.json's flat options."""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
from pathlib import Path

import pytest
from pipeline_helpers import leaf_commands

from adapt.app.cli import build_parser
from adapt.app.commands.run import run_options
from adapt.app.options import add_options, build, default_of, flag_name, flag_spec, groups, option_fields
from adapt.app.pipeline.options import (
    CPU_CLUSTER,
    DEVICE_CHOSEN,
    STAGE_NAMES,
    DeviceDescription,
    PlanOptions,
    RunControl,
    RunOptions,
    ValidationOptions,
)
from adapt.core.errors import BadInput

README = Path(__file__).resolve().parents[2] / "README.md"
TREE = {field.name: (name, field) for name, group in groups(RunOptions) for field in option_fields(group)}
SHARED = {name: entry for name, entry in TREE.items() if entry[0] != "run"}  # RunControl is adapt run's own

# Which commands take which quantity: each of them from the tree (checked below, flag by flag).
VALIDATION_SHAPE = {"device", "dtype", "seq_len", "batch_size"}
SOURCE = {"source", "trust_remote_code", "allow_pickle"}
TAKES = {
    "run": set(TREE),
    "inspect": SOURCE | {"plan_seq_len"},
    "ops": SOURCE | {"profile"},
    "align": SOURCE | VALIDATION_SHAPE | {"seed"},
    "bench": SOURCE | VALIDATION_SHAPE | {"bench_steps"},
    "soak": SOURCE | VALIDATION_SHAPE | {"seed", "soak_steps", "ckpt_every"},
    "generate-check": SOURCE | {"device", "dtype", "seed"},
    "env": {"device", "precision"},
    "plan": SOURCE | {"cluster", "plan_seq_len", "plan_global_batch", "precision"},
    "train": {"source", "trust_remote_code"},
    "launch": {"source", "trust_remote_code"},
    "gate": {"thresholds"},
}


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help is not argparse.SUPPRESS]


def test_field_names_are_unique_across_the_tree():
    names = [field.name for _, group in groups(RunOptions) for field in option_fields(group)]
    assert len(names) == len(set(names))
    assert set(RunOptions.from_dict({"source": "m"}).to_dict()) == {*names, "machine", "device_chosen"}


def test_every_command_takes_each_quantity_under_one_flag_and_default():
    commands = leaf_commands()
    flags = {flag_name(field): name for name, (_, field) in SHARED.items()}
    for command, parser in commands.items():
        taken = set()
        for action in _visible(parser):
            for flag in action.option_strings:  # a tree flag always names the tree's quantity
                if flag in flags:
                    assert action.dest == flags[flag], (command, flag, action.dest)
            if action.dest not in TREE:
                continue
            field = TREE[action.dest][1]
            spec = flag_spec(field)
            taken.add(action.dest)
            expected_flags = [] if spec.flag is None else [flag_name(field)]
            assert action.option_strings == expected_flags, (command, action.dest)
            assert (action.default, action.help) == (default_of(field), spec.help), (command, action.dest)
            assert action.choices == spec.choices and action.type in (spec.type, None), (command, action.dest)
        assert taken == TAKES.get(command, set()), command
    assert set(TAKES) <= set(commands)


def test_old_spellings_still_parse_into_the_same_quantity(rng):
    seq, batch, steps = (rng.randint(2, 4096) for _ in range(3))
    for command in ("run", "align", "bench", "soak"):
        args = build_parser(command).parse_args([command, "m", "--seq", str(seq), "--batch", str(batch)])
        assert (args.seq_len, args.batch_size) == (seq, batch)
    for command, quantity in (("bench", "bench_steps"), ("soak", "soak_steps")):
        assert getattr(build_parser(command).parse_args([command, "m", "--steps", str(steps)]), quantity) == steps
    for spelling in ("--seq-len", "--seq"):
        assert build_parser("inspect").parse_args(["inspect", "m", spelling, str(seq)]).plan_seq_len == seq
    assert build_parser("plan").parse_args(["plan", "m", "--seq", str(seq)]).plan_seq_len == seq


def _random_value(field: dataclasses.Field, rng: random.Random):
    spec, default = flag_spec(field), default_of(field)
    if field.name == "stages":
        return sorted(rng.sample(STAGE_NAMES, rng.randint(1, len(STAGE_NAMES))), key=STAGE_NAMES.index)
    if field.name == "device":
        return rng.choice(["cpu", "cuda", f"cuda:{rng.randint(0, 7)}"])
    if field.name == "profile":  # judged when the options are built: only shipped names pass
        from operators.profiles import available_profiles

        return rng.choice([None, *available_profiles()])
    if isinstance(default, bool):
        return rng.random() < 0.5
    if spec.choices is not None:
        return rng.choice([*spec.choices, *([None] if default is None else [])])
    if spec.type is int:
        return rng.choice([None, rng.randint(spec.minimum, 10_000)]) if default is None else rng.randint(1, 10_000)
    text = f"{rng.choice(['m', 'runs/x', 'org/name@v2'])}-{rng.randint(0, 10**6)}"
    return text if default is dataclasses.MISSING or field.name == "source" else rng.choice([None, text])


def _argv(values: dict) -> list[str]:
    argv = []
    for name, value in values.items():
        field = TREE[name][1]
        if flag_spec(field).flag is None:
            argv.insert(0, str(value))
        elif value is True:
            argv.append(flag_name(field))
        elif value is not None and value is not False:
            argv += [flag_name(field), ",".join(value) if isinstance(value, list) else str(value)]
    return argv


@pytest.mark.parametrize("seed", [random.randrange(2**32) for _ in range(5)])
def test_the_tree_round_trips_through_adapt_run_and_report_json(seed):
    rng = random.Random(seed)
    values = {name: _random_value(field, rng) for name, (_, field) in TREE.items()}
    options = RunOptions.from_dict(values)
    args = build_parser("run").parse_args(["run", *_argv(values)])
    assert run_options(args) == options, seed
    assert RunOptions.from_dict(options.to_dict()) == options
    assert {k: v for k, v in options.to_dict().items() if k in values} == {
        **values,
        "out_dir": values["out_dir"] or options.run.out_dir,
    }


@pytest.mark.parametrize("name", [name for name, _ in groups(RunOptions) if name != "model"])
def test_each_group_round_trips_through_its_own_parser(name, rng):
    group = dict(groups(RunOptions))[name]
    values = {field.name: _random_value(field, rng) for field in option_fields(group)}
    parser = argparse.ArgumentParser()
    add_options(parser, group)
    assert build(group, parser.parse_args(_argv(values))) == group(**values)
    assert build(group, parser.parse_args([])) == group()  # every default is the field's own


def test_bad_values_name_the_flag_they_came_from(rng):
    value = -rng.randint(1, 100)
    for group, name, flag in (
        (PlanOptions, "plan_global_batch", "--global-batch"),
        (PlanOptions, "plan_seq_len", "--plan-seq-len"),
        (ValidationOptions, "soak_steps", "--soak-steps"),
        (ValidationOptions, "ckpt_every", "--ckpt-every"),
    ):
        with pytest.raises(BadInput, match=f"^{flag} is {value}; allowed: an integer >= "):
            build(group, {name: value})
    with pytest.raises(BadInput, match="^--precision is 'fp4'; allowed: bf16, fp8$"):
        PlanOptions(precision="fp4")
    with pytest.raises(BadInput, match="^--device is 'tpu'"):
        ValidationOptions(device="tpu")
    with pytest.raises(BadInput, match="unknown stage"):
        RunControl(stages=["intake", "typo"])


def test_validation_commands_fill_unset_options_as_adapt_run_does():
    args = build_parser("soak").parse_args(["soak", "m", "--seq-len", "16"])
    filled = build(ValidationOptions, args).with_device_defaults(DeviceDescription("cpu"), 256)
    run = RunOptions.from_dict({"source": "m", "seq_len": 16}).with_device_defaults(DeviceDescription("cpu"), 256)
    shape = ("dtype", "seq_len", "batch_size", "soak_steps", "ckpt_every")
    assert {k: getattr(filled, k) for k in shape} == {k: getattr(run.validation, k) for k in shape}
    assert filled.seq_len == 16 and run.plan.cluster == CPU_CLUSTER
    assert run.device_chosen == ("dtype", "batch_size", "bench_steps", "soak_steps", "ckpt_every", "cluster")


def _shown_default(field: dataclasses.Field) -> str:
    default = default_of(field)
    if flag_spec(field).flag is None:
        return "required"
    if field.name == "stages":
        return "all"
    if default is None:
        return "by device" if field.name in DEVICE_CHOSEN else "-"
    return str(default)


def render_tree() -> str:
    """The README's picture of the tree: each group, and each field with its flag, default and the commands taking it."""
    lines = ["RunOptions"]
    tree = list(groups(RunOptions))
    for i, (attr, group) in enumerate(tree):
        last_group = i == len(tree) - 1
        lines.append(f"{'└─' if last_group else '├─'} {attr}: {group.__name__}  {group.__doc__.splitlines()[0]}")
        fields = option_fields(group)
        for j, field in enumerate(fields):
            branch = "└─" if j == len(fields) - 1 else "├─"
            flag = "SOURCE" if flag_spec(field).flag is None else flag_name(field)
            takers = " ".join(command for command, taken in TAKES.items() if field.name in taken)
            line = f"{'   ' if last_group else '│  '}{branch} {field.name:<18} {flag:<20} {_shown_default(field):<9} {takers}"
            lines.append(line.rstrip())
    return "\n".join(lines)


def test_readme_shows_the_tree():
    text = README.read_text()
    found = re.search(r"<!-- options tree -->\n```text\n(.*?)\n```", text, re.S)
    expected = render_tree()
    assert found, "README.md has no options tree block"
    assert found.group(1) == expected, f"README.md's options tree is stale; it should read:\n{expected}"
