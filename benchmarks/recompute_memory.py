"""The planner's activation-memory saving for selective recomputation against the H200's measured peaks.

    PYTHONPATH=$PWD python benchmarks/recompute_memory.py --e2e benchmarks/results/e2e-h200.json --out benchmarks/results

The measurement is the end-to-end benchmark's peak memory of two variants that differ only in recomputation
(``adapt-adamw`` and ``adapt-selective-adamw``: same kernels, compilation and optimizer, same batch).  The
prediction is ``parallel_planner``'s per-token widths that selective recomputation drops, for each model's config
alone (no weights, nothing fitted to these runs), times the tokens of one micro-batch.  Writes
``recompute-memory-h200.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.shapes import SHAPES

KEPT, RECOMPUTED = "adapt-adamw", "adapt-selective-adamw"
ACT_BYTES = 2  # bf16 activations


def config_spec(name: str):
    from adapt.model.intake import build_spec, resolve_source

    with tempfile.TemporaryDirectory() as tmp:
        config = {**SHAPES[name]["full"], "model_type": SHAPES[name]["model_type"]}
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return build_spec(resolve_source(tmp, config_only=True))


def predicted_saving_gib(spec, tokens: int) -> float:
    from parallel_planner.profile import profile_model

    profile = profile_model(spec)
    per_token = sum(
        (b.recomputable_width + b.top_k * b.routed_recomputable_width) * b.count * ACT_BYTES for b in profile.blocks
    )
    return tokens * per_token / 2**30


def predicted_step_cost(spec, batch: int, seq: int) -> float:
    """The tokens/s the planner expects selective recomputation to give up on one H200 at this batch."""
    from parallel_planner.cluster import make_cluster
    from parallel_planner.search import plan_parallel
    from parallel_planner.workload import Workload

    rates = {
        recompute: plan_parallel(
            spec,
            make_cluster("h200", 1),
            Workload(seq_len=seq, global_batch=batch),
            fixed=f"tp=1,pp=1,dp=1,cp=1,mbs={batch},recompute={recompute}",
            top_k=1,
        ).best.tokens_per_s_per_gpu
        for recompute in ("none", "selective")
    }
    return 1 - rates["selective"] / rates["none"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--e2e", required=True, help="an e2e-h200.json with both variants per model")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    report = json.loads(Path(args.e2e).read_text())
    tokens = report["batch"] * report["seq"]
    rows = []
    for name, entry in report["models"].items():
        kept, recomputed = (entry["variants"].get(v) or {} for v in (KEPT, RECOMPUTED))
        if not (kept.get("ok") and recomputed.get("ok")):
            continue
        measured = kept["peak_memory_gib"] - recomputed["peak_memory_gib"]
        spec = config_spec(name)
        predicted = predicted_saving_gib(spec, tokens)
        rows.append(
            {
                "model": name,
                "tokens": tokens,
                "peak_kept_gib": kept["peak_memory_gib"],
                "peak_selective_gib": recomputed["peak_memory_gib"],
                "measured_saving_gib": measured,
                "predicted_saving_gib": predicted,
                "error": (predicted - measured) / measured if measured else None,
                "step_cost": 1 - recomputed["tokens_per_s"] / kept["tokens_per_s"],
                "predicted_step_cost": predicted_step_cost(spec, report["batch"], report["seq"]),
            }
        )
    out = Path(args.out)
    (out / "recompute-memory-h200.json").write_text(json.dumps({"source": args.e2e, "rows": rows}, indent=1))
    lines = [
        "# Selective recomputation: the planner's predicted saving against the measured peak (one H200)",
        "",
        f"From `{args.e2e}`: peak memory of `{KEPT}` minus `{RECOMPUTED}` (same kernels, compilation, optimizer and"
        f" batch of {tokens} tokens). Predicted: `parallel_planner.profile`'s widths that selective recomputation"
        " drops, from the config alone. Step cost: the tokens/s given up, measured and as the planner's time model"
        " predicts it for one H200 at the same batch.",
        "",
        "| model | peak kept GiB | peak selective GiB | measured saving GiB | predicted GiB | error | step cost |"
        " predicted cost |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        error = f"{r['error']:+.0%}" if r["error"] is not None else "–"
        lines.append(
            f"| {r['model']} | {r['peak_kept_gib']:.2f} | {r['peak_selective_gib']:.2f} | {r['measured_saving_gib']:.2f} |"
            f" {r['predicted_saving_gib']:.2f} | {error} | {r['step_cost']:.1%} | {r['predicted_step_cost']:.1%} |"
        )
    (out / "recompute-memory-h200.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
