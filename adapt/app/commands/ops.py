"""``adapt ops``: operator inventory, recognised components, kernel decisions and coverage for a model."""

from __future__ import annotations

import argparse
import json
import sys

from adapt.app.commands.inspect import add_source_flags
from adapt.app.options import add_options
from adapt.app.pipeline.options import OperatorOptions
from adapt.core.errors import CheckFailed


def register(sub) -> None:
    parser = sub.add_parser(
        "ops", help="map every operator of a model to a fused, native, decomposed or generated kernel"
    )
    add_source_flags(parser)
    add_options(parser, OperatorOptions)
    parser.add_argument(
        "--out", default=None, metavar="DIR", help="write ops.json, model.onnx and generated kernel sources here"
    )
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")
    parser.add_argument("--no-onnx", action="store_true", help="skip the ONNX export")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from adapt.app.commands.inspect import resolve_checked

    src = resolve_checked(args)
    from operators import run_ops

    report = run_ops(src, profile=args.profile, out_dir=args.out, onnx=not args.no_onnx)
    data = report.to_dict()
    if args.json:
        json.dump(data, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print(data)
    coverage = data["coverage"]
    if coverage["unmapped"]:
        raise CheckFailed(f"{coverage['unmapped']} ops have no decision")
    check = data.get("patch_check") or {}
    if check.get("ran") and not check.get("passed"):
        raise CheckFailed("the patched model's logits or gradients differ from the unpatched model")
    return 0


def _print(data: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"components ({data['profile']['name']}, {data['target']['device']})")
    for col in ("module", "kind", "provider", "kernel", "status"):
        table.add_column(col)
    for c in data["components"]:
        table.add_row(
            c["module"],
            c["kind"] + ("" if c["confirmed"] else " (unconfirmed)"),
            c["provider"] or "-",
            c["kernel"] or "-",
            c["status"],
        )
    console.print(table)
    flagged = [o for o in data["ops"] if o["status"] not in ("fused", "native")]
    if flagged:
        ops = Table(title="ops not on a fused/native path")
        for col in ("overload", "count", "status", "replacement"):
            ops.add_column(col)
        for o in flagged:
            ops.add_row(o["overload"], str(o["count"]), o["status"], o["replacement"] or "-")
        console.print(ops)
    cov = data["coverage"]
    console.print(
        f"ops {cov['ops_total']}  unmapped {cov['unmapped']}  by status {cov['share_by_status']}  FLOPs on fused/native {cov['flops_share_fused_or_native']}"
    )
    for item in data["new"]:
        console.print(f"new: {item}")
    if data.get("onnx"):
        onnx = data["onnx"]
        console.print(
            f"onnx: exported={onnx['exported']} opset={onnx['opset']} checker={onnx['checker']} ops={sorted(onnx['op_types'])}"
            + (f" error={onnx['error']}" if onnx.get("error") else "")
        )
    for g in data.get("generated", []):
        console.print(f"generated: {g['module']} -> {g['language']} {g['kernels']} {g['files']}")
    if data.get("patch_check"):
        console.print(f"patch check: {data['patch_check']}")
