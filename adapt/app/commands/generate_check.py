"""``adapt generate-check``: greedy generation of the adapted model against the unadapted one.

Exits 0 when every check passed, 1 when one failed or the result is inconclusive (too many
undecidable ties), 2 on bad input.  ``--json`` prints exactly one JSON object.
"""

from __future__ import annotations

import argparse
from typing import Any

from adapt.app.commands.validate import (
    _common,
    _emit,
    _kernel_plan,
    _positive,
    _print_notes,
    _source,
    _table,
)


def register(sub) -> None:
    parser = sub.add_parser(
        "generate-check",
        help="greedy generation vs the unadapted model: tokens, log-probs, KV cache, left-padded batches",
    )
    _common(parser, ("device", "dtype", "seed"))
    parser.add_argument("--prompts", type=int, default=3, help="random prompts (default 3; 2+ for the batch check)")
    parser.add_argument("--prompt-len", type=int, default=12, help="tokens in the longest prompt (default 12)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    parser.add_argument(
        "--reference",
        choices=("fp64", "fp32"),
        default=None,
        help="reference dtype (default fp64 on cpu, fp32 on an accelerator)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from validators.generation import GenerationOptions, generation_check

    _positive(args, "prompts", "prompt_len", "new_tokens")
    (src, shape), notes = _source(args), []
    options = GenerationOptions(
        prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens, seed=shape.seed,
        reference_dtype=args.reference,
    )  # fmt: skip
    plan = _kernel_plan(src, args, notes)
    report = generation_check(src, plan, dtype=shape.dtype, device=shape.device, options=options)
    return _emit(report, args, notes, _print)


def _print(data: dict[str, Any]) -> None:
    rows = [[c["name"], c["steps"], c["worst_err"], c["worst_allowed"], "ok" if c["passed"] else ("-" if not c["checked"] else "FAIL"),
             c["note"]] for c in data["checks"]]  # fmt: skip
    _table(
        f"generation {data['dtype']} vs {data['reference_dtype']} reference",
        ["check", "steps", "worst err", "allowed", "", "note"],
        rows,
    )
    for tie in data["ties"]:
        print(
            f"undecidable: prompt {tie['prompt']} step {tie['step']}: token {tie['candidate_token']} vs {tie['reference_token']} "
            f"(gap {tie['gap']:.3g} nats within the dtype's margin {tie['margin']:.3g})"
        )
    _print_notes(data)
    print(f"{data['verdict'].upper()}: {data['summary']}")
