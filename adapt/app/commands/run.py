"""``adapt run SOURCE``: the whole pipeline, resumable, with reports and a CI exit code."""

from __future__ import annotations

import argparse
import json
import os
import sys

from adapt.app.commands.flags import add_json
from adapt.app.options import add_options, groups
from adapt.app.pipeline.options import (
    STAGE_NAMES,
    RunControl,
    RunOptions,
    comma_list,
    defaults_help,
    select_stages,
)
from adapt.app.pipeline.progress import RunProgress
from adapt.app.pipeline.runner import run_pipeline


def _quiet_third_party_progress() -> None:
    """transformers' and the hub's tqdm bars would tear through the live stage display.

    transformers reads the hub's switch when it is imported; only an already imported one is told
    directly, so a bad option is still answered before transformers (and torch) load.
    """
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="run every stage on a model and write report.{json,md,html} and junit.xml",
        description="Stages: " + " → ".join((*STAGE_NAMES, "report")) + ". Finished stages are reused on a rerun "
        "unless --force is given or the source changed. Exit code 0: every stage passed; 1: a stage or an alignment "
        "check failed; 2: bad input.",
        epilog=defaults_help(),
    )
    for name, group in groups(RunOptions):  # the whole tree, one section of --help per group
        section = p.add_argument_group(f"{name}: {group.__doc__.splitlines()[0].rstrip('.')}")
        add_options(section, group)
        if group is RunControl:
            section.add_argument("--skip", type=comma_list, help="comma list of stages to leave out")
    p.add_argument(
        "--quiet", action="store_true", help="print nothing; the exit code and the report files tell the result"
    )
    add_json(p, "report.json")
    p.set_defaults(func=handle)


def run_options(args: argparse.Namespace) -> RunOptions:
    """The options tree from ``adapt run``'s parsed arguments (``--skip`` taken out of ``--stages``)."""
    return RunOptions.from_dict({**vars(args), "stages": select_stages(args.stages, args.skip)})


def handle(args: argparse.Namespace) -> int:
    _quiet_third_party_progress()
    options = run_options(args)
    progress = RunProgress(quiet=args.quiet or args.json)
    outcome = run_pipeline(options, progress)
    if args.json:
        json.dump(outcome.report, sys.stdout)
        sys.stdout.write("\n")
    elif not args.quiet:
        progress.console.print(
            f"[bold]{outcome.report['status'].upper()}[/] (exit {outcome.exit_code}) — "
            f"report: {outcome.out_dir / 'report.md'}, {outcome.out_dir / 'report.html'}, "
            f"{outcome.out_dir / 'junit.xml'}",
            highlight=False,
        )
    bad_input = next((r for r in outcome.report.get("stages", []) if r.get("error_kind") == "BadInput"), None)
    if outcome.exit_code == 2 and bad_input is not None:  # one readable line, also under --quiet and --json
        why = str(bad_input.get("error") or bad_input["verdict"]).removeprefix("BadInput: ")
        print(f"adapt: error: {bad_input['name']}: {why}", file=sys.stderr)
    return outcome.exit_code
