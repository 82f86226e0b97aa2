"""``adapt inspect``: describe a checkpoint without loading its tensors."""

from __future__ import annotations

import argparse
import json
import sys

from adapt.app.options import add_options, build
from adapt.app.pipeline.options import ModelOptions, PlanOptions, max_positions
from adapt.core.spec import ModelSpec


def add_source_flags(parser: argparse.ArgumentParser) -> None:
    """Flags every command that reads a checkpoint shares: the model options, and ``--config-only``."""
    add_options(parser, ModelOptions)
    parser.add_argument(
        "--config-only", action="store_true", help="never touch the weights (structure from config.json)"
    )


def resolve_checked(args: argparse.Namespace, config_only: bool | None = None):
    """The source, resolved without importing torch (bad ids and configs answer at once), then the config
    checked by transformers' own validation; its rejections are bad input, not internal errors."""
    from adapt.core.inputs import check_with_transformers
    from adapt.core.source import resolve_source

    src = resolve_source(
        args.source,
        config_only=args.config_only if config_only is None else config_only,
        trust_remote_code=args.trust_remote_code,
        allow_pickle=args.allow_pickle,
    )
    check_with_transformers(src.config_dict, src.config_path)
    return src


def register(sub) -> None:
    parser = sub.add_parser("inspect", help="describe a checkpoint: architecture, parameters, FLOPs, KV cache")
    add_source_flags(parser)
    # the spec's FLOP and KV figures are for the sequence a plan targets (`adapt plan` builds the same spec)
    add_options(parser, PlanOptions, only=("plan_seq_len",), old={"plan_seq_len": ("--seq-len", "--seq")})
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    seq_len = build(PlanOptions, args).plan_seq_len
    positions = max_positions(resolve_checked(args).config_dict or {})
    from adapt.model.intake import inspect

    spec = inspect(
        args.source,
        config_only=args.config_only,
        trust_remote_code=args.trust_remote_code,
        allow_pickle=args.allow_pickle,
        seq_len=min(seq_len, positions or seq_len),
    )
    if args.json:
        json.dump(spec.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    else:
        print_summary(spec)
    return 0


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def print_summary(spec: ModelSpec) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    p = spec.params
    console.print(
        f"[bold]{spec.model_type}[/bold] ({spec.model_class}) from {spec.source}: "
        f"{spec.num_layers} blocks, width {spec.hidden_size}, vocab {spec.vocab_size}, "
        f"{'causal' if spec.is_causal else 'bidirectional'}"
    )
    console.print(
        f"parameters {_human(p.total)} total, {_human(p.active_per_token)} active per token; "
        f"forward {_human(spec.cost.forward_flops_per_token)}FLOP/token, train {_human(spec.cost.train_flops_per_token)}FLOP/token "
        f"at seq {spec.cost.seq_len}; KV cache {spec.cost.kv_cache_bytes_per_token:,} B/token"
    )
    table = Table(title="distinct blocks")
    for col in ("blocks", "mixer", "attention", "mlp", "norm", "params"):
        table.add_column(col)
    for block in spec.distinct_blocks():
        same = [b.index for b in spec.blocks if b.signature() == block.signature()]
        a, m, n = block.attention, block.mlp, block.norm
        attn = (
            "-"
            if a is None
            else f"{a.kind} {a.num_heads}h/{a.num_kv_heads}kv d{a.head_dim}"
            + (f" win{a.window}" if a.window else "")
            + (" kv-shared" if a.kv_shared else "")
        )
        mlp = f"{m.kind} {m.intermediate_size} {m.activation}" + (
            f" E{m.num_experts} top{m.top_k}" if m.kind == "moe" else ""
        )
        norm = f"{n.kind} {n.placement}" + (" (1+w)" if n.offset else "")
        mixer = block.mixer + (f" + {block.second_mixer}" if block.second_mixer else "")
        table.add_row(f"{len(same)}× from {same[0]}", mixer, attn, mlp, norm, _human(block.params))
    console.print(table)
    breakdown = ", ".join(
        f"{k} {_human(v)}" for k, v in vars(p).items() if v and k not in ("total", "active_per_token")
    )
    console.print(f"parameter breakdown: {breakdown}")
    if spec.checkpoint:
        ck = spec.checkpoint
        console.print(
            f"checkpoint: {len(ck.files)} file(s), {ck.num_tensors} tensors, {ck.total_bytes / 2**20:.1f} MiB, dtypes {ck.dtypes}; "
            f"missing {len(ck.missing)}, unexpected {len(ck.unexpected)}, tied groups {len(ck.tied)}"
        )
        if ck.quantization:
            console.print(
                f"{ck.quantization_line()}: {len(ck.quantization_tensors)} tensors in the quantisation's own form; "
                "loaded dequantized where transformers can do so"
            )
    if spec.features:
        console.print("known traits: " + "; ".join(spec.features))
    if spec.novelties:
        console.print("what is new in this model:")
        for note in spec.novelties:
            console.print(f"  - {note}")
