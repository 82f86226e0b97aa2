"""``adapt align | bench | soak | env``: the validation stages on their own.

Each prints one JSON object with ``--json`` (else a short table), exits 0 when the stage passed,
1 when it ran and failed, 2 on bad input.  The candidate is the model with the operators' kernel
plan applied; ``--no-kernels`` (or an operators package without a planner) validates the
unmodified model, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from adapt.app.commands.flags import add_validation_shape
from adapt.app.commands.inspect import add_source_flags
from adapt.core.errors import BadInput

DTYPE_CHOICES = ("bf16", "fp16", "fp32")


def register(sub) -> None:
    align = sub.add_parser("align", help="compare the adapted model with a float64 reference, block by block")
    _common(align)
    align.add_argument("--dtype", choices=DTYPE_CHOICES, default="bf16", help="candidate dtype (default bf16)")
    align.add_argument(
        "--streamed", action="store_true", help="one block at a time from the shards (checkpoints bigger than memory)"
    )
    add_validation_shape(align)
    align.add_argument("--seed", type=int, default=None, help="input seed (default: fresh random)")
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
    _common(bench)
    bench.add_argument("--dtype", choices=DTYPE_CHOICES, default="bf16")
    add_validation_shape(bench)  # unset batch on CUDA: as many sequences as fit 60% of free memory
    bench.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed training steps per variant, after 2 warm-up (default: cpu 6, cuda 20)",
    )
    bench.add_argument(
        "--compile", action="store_true", help="add the torch.compile baseline on a CPU too (always on CUDA)"
    )
    bench.add_argument("--max-layers", type=int, default=None, help="measure only the first N blocks, at real width")
    bench.add_argument("--calibration-out", default=None, help="write the planner calibration JSON here")
    bench.set_defaults(func=run_bench)

    soak = sub.add_parser(
        "soak", help="train for N steps: finite loss, step-time drift, memory leaks, checkpoint/resume"
    )
    _common(soak)
    soak.add_argument("--steps", type=int, required=True)
    soak.add_argument("--minutes", type=float, default=None, help="stop after this many minutes")
    soak.add_argument("--ckpt-every", type=int, default=0)
    soak.add_argument("--ckpt-dir", default=None, help="checkpoint directory; an existing checkpoint there is resumed")
    soak.add_argument("--dtype", choices=DTYPE_CHOICES, default="bf16")
    add_validation_shape(soak)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--nondeterministic", action="store_true", help="allow nondeterministic kernels")
    soak.set_defaults(func=run_soak)

    env = sub.add_parser("env", help="versions, devices, measured copy/matmul/all-reduce rates, problems")
    env.add_argument("--precision", choices=("bf16", "fp16", "fp32", "fp8"), default="bf16")
    env.add_argument("--plan", default=None, help="a ParallelPlan JSON to check against this machine")
    env.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    env.add_argument("--json", action="store_true")
    env.set_defaults(func=run_env)


def _common(parser: argparse.ArgumentParser) -> None:
    add_source_flags(parser)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--no-kernels", action="store_true", help="validate the unmodified model (no kernel plan)")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise BadInput(f"--{name.replace('_', '-')} is {value}; allowed: an integer >= 1")


def _source(args: argparse.Namespace):
    from adapt.app.commands.inspect import resolve_checked

    if args.config_only:
        raise BadInput("validation runs the model: --config-only cannot be used here")
    src = resolve_checked(args)
    # bench sizes an unset batch on CUDA from free memory itself
    sized = ("seq_len",) if args.func is run_bench and args.device != "cpu" else ("seq_len", "batch_size")
    _fill_device_shape(args, getattr(src, "config_dict", {}) or {}, sized)
    return src


def _fill_device_shape(args: argparse.Namespace, config: dict[str, Any], names: tuple[str, ...]) -> None:
    """Unset ``--seq-len`` / ``--batch-size`` take the device's defaults, exactly as ``adapt run`` chooses them."""
    from adapt.app.pipeline.options import DeviceDescription, choose_defaults, max_positions

    defaults = choose_defaults(DeviceDescription.of(args.device), max_positions(config))
    for name in names:
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(defaults, name))
    _positive(args, "seq_len", "batch_size")


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
    _positive(args, "seq_len", "batch_size")
    src, notes = _source(args), []
    if args.seq_len < 2:
        raise BadInput(f"--seq-len is {args.seq_len}; allowed: an integer >= 2 (next-token targets)")
    from validators.align import AlignOptions, align

    plan = _kernel_plan(src, args, notes)
    options = AlignOptions(
        batch=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        backward=not args.no_backward,
        parity_steps=args.parity_steps,
        reference_dtype=args.reference,
    )
    report = align(src, plan, dtype=args.dtype, device=args.device, streamed=args.streamed, options=options)
    return _emit(report, args, notes, _print_align)


def run_bench(args: argparse.Namespace) -> int:
    _positive(args, "seq_len", "batch_size", "steps", "max_layers")
    src, notes = _source(args), []
    from validators.throughput import BenchOptions, bench

    plan = _kernel_plan(src, args, notes)
    options = BenchOptions(
        dtype=args.dtype,
        seq_len=args.seq_len,
        batch=args.batch_size,
        steps=args.steps,
        compile=True if args.compile else None,
        max_layers=args.max_layers,
    )
    report = bench(src, plan, device=args.device, options=options)
    if args.calibration_out:
        with open(args.calibration_out, "w") as fh:
            json.dump(report.calibration, fh, indent=2)
    return _emit(report, args, notes, _print_bench)


def run_soak(args: argparse.Namespace) -> int:
    _positive(args, "steps", "seq_len", "batch_size")
    if args.ckpt_every < 0:
        raise BadInput(f"--ckpt-every is {args.ckpt_every}; allowed: an integer >= 0 (0: no checkpoints)")
    src, notes = _source(args), []
    from validators.soak import soak

    plan = _kernel_plan(src, args, notes)
    report = soak(
        src,
        plan,
        steps=args.steps,
        ckpt_every=args.ckpt_every,
        device=args.device,
        dtype=args.dtype,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        ckpt_dir=args.ckpt_dir,
        minutes=args.minutes,
        seed=args.seed,
        deterministic=not args.nondeterministic,
    )
    return _emit(report, args, notes, _print_soak)


def run_env(args: argparse.Namespace) -> int:
    from parallel_planner.plan import ParallelPlan

    plan = None
    if args.plan:
        try:
            plan = ParallelPlan.load(args.plan)
        except (OSError, ValueError, TypeError) as err:
            raise BadInput(f"{args.plan}: not a readable plan JSON ({err})") from None
    from validators.environment import (
        check_environment,  # torch: only once the input is known to be usable
    )

    report = check_environment(plan, precision=args.precision, device=args.device)
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
