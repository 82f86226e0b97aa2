"""Flags that name the same quantity in several commands: one spelling and one default each.

Older spellings (``--seq``, ``--batch``) still parse, hidden from ``--help``, so scripts keep working.
"""

from __future__ import annotations

import argparse

# Validation shapes (alignment, throughput, soak) are chosen by --device: adapt.app.pipeline.options.choose_defaults.
BY_DEVICE = "default: chosen by --device, see `adapt run --help`"
# What the parallel plan targets on the cluster.
DEFAULT_CLUSTER = "8xH100"
DEFAULT_PLAN_SEQ_LEN = 4096
DEFAULT_GLOBAL_BATCH = 64
CLUSTER_HELP = "target cluster: <N>x<GPU> (e.g. 8xH100), a cluster YAML/TOML file, or 'local' (measured)"


def hidden_alias(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, dest: str, **kwargs) -> None:
    """An old spelling of a flag: parsed into the same ``dest``, not shown in ``--help``."""
    parser.add_argument(flag, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


def add_validation_shape(parser: argparse.ArgumentParser) -> None:
    """``--seq-len`` and ``--batch-size`` of the validation runs: one spelling and one device-chosen default."""
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence ({BY_DEVICE})")
    hidden_alias(parser, "--seq", "seq_len", type=int)
    parser.add_argument("--batch-size", type=int, help=f"sequences per batch ({BY_DEVICE})")
    hidden_alias(parser, "--batch", "batch_size", type=int)


def add_plan_target(parser: argparse.ArgumentParser | argparse._ArgumentGroup, old_spelling: str | None = None) -> None:
    """``--plan-seq-len`` (the sequence length the plan targets), as ``adapt run`` and ``adapt plan`` spell it."""
    parser.add_argument(
        "--plan-seq-len",
        type=int,
        default=DEFAULT_PLAN_SEQ_LEN,
        help=f"sequence length the plan targets (default {DEFAULT_PLAN_SEQ_LEN}, capped at the model's max positions)",
    )
    if old_spelling:
        hidden_alias(parser, old_spelling, "plan_seq_len", type=int)


def add_json(parser: argparse.ArgumentParser, what: str = "the result") -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as exactly one JSON object on stdout")
