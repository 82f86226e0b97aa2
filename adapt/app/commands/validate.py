"""``adapt align | bench | soak | env``: the validation stages on their own.

Each prints one JSON object with ``--json`` (else a short table), exits 0 when the stage passed,
1 when it ran and failed, 2 on bad input.  The candidate is the model with the operators' kernel
plan applied; ``--no-kernels`` (or an operators package without a planner) validates the
unmodified model, and the output says so.  Device, dtype, shapes and step counts are the options tree's
(``ValidationOptions``): the same flags and defaults as ``adapt run``, unset ones chosen by the device.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from adapt.app.commands.flags import add_json
from adapt.app.commands.inspect import add_source_flags
from adapt.app.options import add_options, build
from adapt.app.pipeline.options import PlanOptions, ValidationOptions
from adapt.core.errors import BadInput

SHAPE = ("device", "dtype", "seq_len", "batch_size")  # what every validation command runs at


def register(sub) -> None:
    align = sub.add_parser("align", help="compare the adapted model with a float64 reference, block by block")
    _common(align, (*SHAPE, "seed"))
    align.add_argument(
        "--streamed", action="store_true", help="one block at a time from the shards (checkpoints bigger than memory)"
    )
    align.add_argument("--no-backward", action="store_true", help="skip gradients and the loss-parity run")
    align.add_argument("--parity-steps", type=int, default=4, help="loss-curve parity steps (default 4)")
    align.add_argument(
        "--reference",
        choices=("fp64", "fp32"),
        default=None,
        help="reference dtype (default fp64; fp32 from width 4096)",
    )
    align.set_defaults(func=run_align)

    bench = sub.add_parser(
        "bench", help="training step, prefill and decode throughput, MFU, memory; adapted vs eager and torch.compile"
    )
    # an unset batch on CUDA: as many sequences as fit 60% of free memory
    _common(bench, (*SHAPE, "bench_steps"), old={"bench_steps": ("--steps",)})
    bench.add_argument(
        "--compile", action="store_true", help="add the torch.compile baseline on a CPU too (always on CUDA)"
    )
    bench.add_argument("--max-layers", type=int, default=None, help="measure only the first N blocks, at real width")
    bench.add_argument("--calibration-out", default=None, help="write the planner calibration JSON here")
    bench.set_defaults(func=run_bench)

    soak = sub.add_parser(
        "soak", help="train for N steps: finite loss, step-time drift, memory leaks, checkpoint/resume"
    )
    _common(soak, (*SHAPE, "seed", "soak_steps", "ckpt_every"), old={"soak_steps": ("--steps",)})
    soak.add_argument("--minutes", type=float, default=None, help="stop after this many minutes")
    soak.add_argument(
        "--ckpt-dir",
        default=None,
        help="checkpoint directory; an existing checkpoint there is resumed (without it: no checkpoints)",
    )
    soak.add_argument("--nondeterministic", action="store_true", help="allow nondeterministic kernels")
    soak.set_defaults(func=run_soak)

    env = sub.add_parser("env", help="versions, devices, measured copy/matmul/all-reduce rates, problems")
    add_options(env, ValidationOptions, only=("device",))
    add_options(env, PlanOptions, only=("precision",))
    env.add_argument("--plan", default=None, help="a ParallelPlan JSON to check against this machine")
    add_json(env)
    env.set_defaults(func=run_env)


def _common(parser: argparse.ArgumentParser, fields: tuple[str, ...], old: dict | None = None) -> None:
    add_source_flags(parser)
    add_options(parser, ValidationOptions, only=fields, old=old)
    parser.add_argument("--no-kernels", action="store_true", help="validate the unmodified model (no kernel plan)")
    add_json(parser)


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise BadInput(f"--{name.replace('_', '-')} is {value}; allowed: an integer >= 1")


def _source(args: argparse.Namespace) -> tuple[Any, ValidationOptions]:
    """The source and the validation options, every unset one chosen by the device exactly as ``adapt run`` does.

    The options are checked before the source is read: a bad flag answers at once.
    """
    from adapt.app.commands.inspect import resolve_checked
    from adapt.app.pipeline.options import DeviceDescription, max_positions
    from adapt.app.pipeline.preflight import check_validation_shape

    options = build(ValidationOptions, args)
    if args.config_only:
        raise BadInput("validation runs the model: --config-only cannot be used here")
    src = resolve_checked(args)
    config = getattr(src, "config_dict", {}) or {}
    positions = max_positions(config)
    options = options.with_device_defaults(DeviceDescription.of(options.device), positions)
    check_validation_shape(options, ["alignment"], positions, config)  # every validation command runs the model
    return src, options


def _kernel_plan(src, args: argparse.Namespace, notes: list[str]) -> Any:
    """The operators' kernel plan for ``src``, or None (with a note saying the candidate is unmodified)."""
    if args.no_kernels:
        notes.append("--no-kernels: the candidate is the unmodified model")
        return None
    from operators import run_ops

    return run_ops(src, trust_remote_code=src.trust_remote_code, onnx=False, check_patch=False).plan


def _emit(result, args: argparse.Namespace, notes: list[str], summary) -> int:
    data = result.to_dict()
    data["notes"] = notes + list(data.get("notes") or [])
    if args.json:
        json.dump(data, sys.stdout)
        sys.stdout.write("\n")
    else:
        summary(data)
    return 0 if result.passed else 1


def run_align(args: argparse.Namespace) -> int:
    (src, shape), notes = _source(args), []
    if shape.seq_len < 2:
        raise BadInput(f"--seq-len is {shape.seq_len}; allowed: an integer >= 2 (next-token targets)")
    from validators.align import AlignOptions, align

    plan = _kernel_plan(src, args, notes)
    options = AlignOptions(
        batch=shape.batch_size,
        seq_len=shape.seq_len,
        seed=shape.seed,
        backward=not args.no_backward,
        parity_steps=args.parity_steps,
        reference_dtype=args.reference,
    )
    report = align(src, plan, dtype=shape.dtype, device=shape.device, streamed=args.streamed, options=options)
    return _emit(report, args, notes, _print_align)


def run_bench(args: argparse.Namespace) -> int:
    _positive(args, "max_layers")
    (src, shape), notes = _source(args), []
    from validators.throughput import BenchOptions, bench

    plan = _kernel_plan(src, args, notes)
    # a batch the device would choose is left to the bench on a GPU, which sizes the step from free memory
    sized_by_bench = shape.device != "cpu" and args.batch_size is None
    options = BenchOptions(
        dtype=shape.dtype,
        seq_len=shape.seq_len,
        batch=None if sized_by_bench else shape.batch_size,
        steps=shape.bench_steps,
        compile=True if args.compile else None,
        max_layers=args.max_layers,
    )
    report = bench(src, plan, device=shape.device, options=options)
    if args.calibration_out:
        with open(args.calibration_out, "w") as fh:
            json.dump(report.calibration, fh, indent=2)
    return _emit(report, args, notes, _print_bench)


def run_soak(args: argparse.Namespace) -> int:
    (src, shape), notes = _source(args), []
    from validators.soak import soak

    plan = _kernel_plan(src, args, notes)
    # the device's checkpoint interval applies where checkpoints go; an explicit one without a directory is refused
    no_checkpoints = args.ckpt_dir is None and args.ckpt_every is None
    report = soak(
        src,
        plan,
        steps=shape.soak_steps,
        ckpt_every=0 if no_checkpoints else shape.ckpt_every,
        device=shape.device,
        dtype=shape.dtype,
        seq_len=shape.seq_len,
        batch_size=shape.batch_size,
        ckpt_dir=args.ckpt_dir,
        minutes=args.minutes,
        seed=shape.seed,
        deterministic=not args.nondeterministic,
    )
    return _emit(report, args, notes, _print_soak)


def run_env(args: argparse.Namespace) -> int:
    device, precision = build(ValidationOptions, args).device, build(PlanOptions, args).precision
    from parallel_planner.plan import ParallelPlan

    plan = None
    if args.plan:
        plan = ParallelPlan.load(args.plan)
    from validators.environment import (
        check_environment,  # torch: only once the input is known to be usable
    )

    report = check_environment(plan, precision=precision, device=device)
    return _emit(report, args, [], _print_env)


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row])
    Console().print(table)


def _print_notes(data: dict[str, Any]) -> None:
    for note in data.get("notes") or []:
        print(f"note: {note}")


def _print_align(data: dict[str, Any]) -> None:
    rows = [
        [l["name"], l["cosine"], l["rel_err"], l["max_abs"], l["err_ratio"], "ok" if l["passed"] else "FAIL"]
        for l in data["layers"]
    ]
    _table(
        f"alignment {data['dtype']} vs {data['reference_dtype']} reference",
        ["tensor", "cosine", "rel_err", "max_abs", "err_ratio", ""],
        rows,
    )
    failed = [g["name"] for g in data["gradients"] if not g["passed"]]
    print(f"gradients: {len(data['gradients']) - len(failed)}/{len(data['gradients'])} within limits")
    if data.get("parity"):
        p = data["parity"]
        print(
            f"loss parity over {p['steps']} steps: max rel diff {p['max_rel_diff']:.3g} (tolerance {p['tolerance']:.3g})"
        )
    _print_notes(data)
    print("PASSED" if data["passed"] else f"FAILED: first divergent {data['first_divergent']}")


def _print_bench(data: dict[str, Any]) -> None:
    rows = [
        [
            v["name"],
            v["train_tokens_per_s"],
            v["mfu"] if v["mfu"] is not None else "-",
            v["prefill_tokens_per_s"],
            v["decode_tokens_per_s"],
            v["peak_memory_bytes"] / 2**30,
        ]
        for v in data["variants"]
    ]
    _table(
        f"throughput on {data['device_name']} ({data['dtype']}, {data['batch']}x{data['seq_len']})",
        ["variant", "train tok/s", "MFU", "prefill tok/s", "decode tok/s", "peak GiB"],
        rows,
    )
    _print_notes(data)
    print(f"shapes: {data['shapes_basis']}")
    print(f"{data['verdict'].upper()}: " + "; ".join(data["reasons"]))


def _print_soak(data: dict[str, Any]) -> None:
    losses = data["losses"]
    print(
        f"{data['steps_done']}/{data['steps_planned']} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        if losses
        else "no steps run"
    )
    print(
        f"step-time CV {data['step_time_cv']}, drift {data['step_time_drift']}, memory slope {data['memory_slope_bytes_per_step']} B/step, leak {data['leak']}"
    )
    _print_notes(data)
    print("PASSED" if data["passed"] else "FAILED")


def _print_env(data: dict[str, Any]) -> None:
    print(json.dumps(data["versions"]))
    for d in data["devices"]:
        print(f"GPU {d['index']}: {d['name']} sm_{d['capability']} {d['memory_bytes'] / 2**30:.0f} GiB")
    print(
        f"copy {data['copy_gbps']} GB/s, matmul {data['matmul_tflops']} TFLOP/s ({data['matmul_dtype']}), all-reduce {data['allreduce_gbps']} GB/s"
    )
    for p in data["problems"]:
        print(f"problem: {p}")
    for u in data["unchecked"]:
        print(f"not checked: {u}")
