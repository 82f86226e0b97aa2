"""``adapt plan --mode inference``: a serving layout, its KV-cache budget and time per output token."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from adapt.core.errors import BadInput


def _cluster(args: argparse.Namespace) -> Any:
    """The same cluster forms and default as a training plan (``adapt plan --help``)."""
    from adapt.app.clusters import local_cluster, target_cluster
    from adapt.app.pipeline.options import CPU_CLUSTER
    from parallel_planner.cluster import make_cluster

    if args.gpu == "local" and not args.cluster:
        return local_cluster()
    if args.gpu:
        return make_cluster(args.gpu, args.gpus or 8, args.gpus_per_node)
    return target_cluster(args.cluster or CPU_CLUSTER)


def run_inference_plan(args: argparse.Namespace, spec_loader: Any) -> int:
    """Plan serving for ``--plan-seq-len`` tokens of context and ``--concurrency`` (or ``--global-batch``) sequences."""
    try:
        if args.global_batch_tokens is not None or args.fixed or args.calibration:
            raise BadInput("--mode inference takes --concurrency (not --global-batch-tokens, --fixed or --calibration)")
        from parallel_planner.inference import ServingWorkload, plan_inference

        cluster = _cluster(args)
        workload = ServingWorkload(
            context_len=args.plan_seq_len, concurrency=args.concurrency or args.plan_global_batch, precision=args.precision,
            kv_bytes=1 if args.kv_cache_dtype == "fp8" else 2, gpu_memory_utilization=args.gpu_memory_utilization,
        )  # fmt: skip
    except BaseException:
        spec_loader.cancel()
        raise
    spec = spec_loader.result()
    result = plan_inference(spec, cluster, workload, top_k=args.top)
    if args.json:
        json.dump(result.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    else:
        _print(result)
    return 0


def _print(result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    from parallel_planner.inference import settings_line

    console = Console()
    c, w = result.cluster, result.workload
    console.print(f"[bold]{result.source}[/bold] served on {c['num_gpus']} x {c['gpu']['name']}: context {w['context_len']}, "
                  f"{w['concurrency']} concurrent sequences; {result.searched} layouts scored, {result.feasible} fit")  # fmt: skip
    table = Table()
    for col in ("#", "tp", "pp", "ep", "replicas", "GiB/GPU", "KV GiB/seq", "max seqs", "ms/token", "tokens/s", "fits"):
        table.add_column(col, justify="right")
    for p in result.plans:
        table.add_row(str(p.rank), str(p.tp), str(p.pp), str(p.ep), str(p.replicas), f"{p.memory_gib_per_gpu:.1f}",
                      f"{p.kv_gib_per_sequence:.3f}", f"{p.max_concurrent_sequences:,}", f"{1e3 * p.time_per_output_token_s:.2f}",
                      f"{p.output_tokens_per_s:,.0f}", "yes" if p.fits else "no")  # fmt: skip
    console.print(table)
    best = result.best
    console.print(
        "memory of the best plan (GiB per GPU, fullest stage): "
        + ", ".join(f"{k} {v:.2f}" for k, v in best.memory_breakdown.items())
    )
    console.print("time per token parts (s): " + ", ".join(f"{k} {v:.2e}" for k, v in best.time_breakdown.items()))
    for note in result.notes:
        console.print(f"note: {note}")
    console.print(f"vLLM settings: {settings_line(best.vllm)}")
