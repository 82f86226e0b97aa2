"""``adapt run SOURCE``: the whole pipeline, resumable, with reports and a CI exit code."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from adapt.app.commands.flags import (
    CLUSTER_HELP,
    DEFAULT_GLOBAL_BATCH,
    add_json,
    add_plan_target,
    add_validation_shape,
)
from adapt.app.pipeline import (
    STAGE_NAMES,
    RunOptions,
    RunProgress,
    run_pipeline,
    select_stages,
)
from adapt.app.pipeline.options import defaults_help


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def default_out_dir(source: str) -> str:
    name = Path(source.rstrip("/")).name or "model"
    return str(Path("adapt-runs") / name.replace("@", "_"))


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
    p.add_argument("source", help="Hugging Face id (org/name[@revision]), checkpoint directory, or config.json")
    p.add_argument("--out", help="output directory (default: adapt-runs/<name>)")
    p.add_argument(
        "--stages", type=_comma_list, help=f"comma list of stages to run (default: all of {','.join(STAGE_NAMES)})"
    )
    p.add_argument("--skip", type=_comma_list, help="comma list of stages to leave out")
    p.add_argument("--force", action="store_true", help="recompute every selected stage, ignoring stored results")
    p.add_argument(
        "--cluster",
        help=f"{CLUSTER_HELP}; default: chosen by --device (see below)",
    )
    p.add_argument("--profile", help="backend profile (name or file) for the operator mapping")
    p.add_argument("--device", default="cpu", help="device for alignment/throughput/soak (default cpu)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="candidate dtype (default: chosen by --device)")
    by_device = "(default: chosen by --device)"
    add_validation_shape(p)
    p.add_argument("--bench-steps", type=int, help=f"timed steps per throughput measurement {by_device}")
    p.add_argument("--soak-steps", type=int, help=f"training steps of the soak {by_device}")
    p.add_argument("--ckpt-every", type=int, help=f"soak checkpoint interval in steps {by_device}")
    add_plan_target(p)
    p.add_argument(
        "--global-batch",
        type=int,
        default=DEFAULT_GLOBAL_BATCH,
        help=f"global batch (sequences) the plan targets (default {DEFAULT_GLOBAL_BATCH})",
    )
    p.add_argument(
        "--precision", choices=("bf16", "fp8"), default="bf16", help="training precision for plan/environment"
    )
    p.add_argument("--thresholds", help="alignment thresholds file (YAML/JSON) passed to the alignment stage")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modelling code to run")
    p.add_argument("--allow-pickle", action="store_true", help="allow pickled (.bin) weights")
    p.add_argument(
        "--quiet", action="store_true", help="print nothing; the exit code and the report files tell the result"
    )
    add_json(p, "report.json")
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    _quiet_third_party_progress()
    options = RunOptions(
        source=args.source,
        out_dir=args.out or default_out_dir(args.source),
        stages=select_stages(args.stages, args.skip),
        force=args.force,
        trust_remote_code=args.trust_remote_code,
        allow_pickle=args.allow_pickle,
        profile=args.profile,
        cluster=args.cluster,
        plan_seq_len=args.plan_seq_len,
        plan_global_batch=args.global_batch,
        precision=args.precision,
        device=args.device,
        dtype=args.dtype,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        bench_steps=args.bench_steps,
        soak_steps=args.soak_steps,
        ckpt_every=args.ckpt_every,
        thresholds=args.thresholds,
    )
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
    return outcome.exit_code
