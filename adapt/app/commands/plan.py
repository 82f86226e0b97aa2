"""``adapt plan``: lay a model out on a cluster (TP/PP/DP/CP/EP, ZeRO, recompute, batching) before a GPU-hour."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from adapt.app.commands.flags import add_json
from adapt.app.commands.inspect import add_source_flags
from adapt.app.options import add_options, build
from adapt.app.pipeline.options import CPU_CLUSTER, PlanOptions
from adapt.core.errors import BadInput
from adapt.core.inputs import read_input_text
from adapt.core.spec import ModelSpec


def register(sub) -> None:
    parser = sub.add_parser("plan", help="search parallel layouts: memory per GPU, step time, tokens/s, MFU")
    add_source_flags(parser)
    cluster = parser.add_argument_group("cluster (a catalogue GPU, a cluster file, or this machine)")
    add_options(cluster, PlanOptions, only=("cluster",))
    cluster.add_argument(
        "--gpu", default=None, help="GPU type: a100, h100, h800, h200, b200, mi300x, or 'local' (measured)"
    )
    cluster.add_argument("--gpus", type=int, default=None, help="number of GPUs (with --gpu; default 8)")
    cluster.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the GPU type's)")
    work = parser.add_argument_group("workload")
    add_options(work, PlanOptions, only=("plan_seq_len",), old={"plan_seq_len": ("--seq",)})
    batch = work.add_mutually_exclusive_group()
    add_options(batch, PlanOptions, only=("plan_global_batch",))
    batch.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    batch.add_argument(
        "--concurrency",
        type=int,
        help="--mode inference: sequences served at once (default: --global-batch; --plan-seq-len is the context)",
    )
    add_options(work, PlanOptions, only=("precision",))
    work.add_argument("--mode", choices=("train", "inference"), default="train")
    work.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="--mode inference: share of GPU memory to use"
    )
    work.add_argument(
        "--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16", help="--mode inference: KV-cache element type"
    )
    work.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, lion or adafactor (state size)")
    work.add_argument(
        "--moe-imbalance",
        type=float,
        default=1.1,
        help="routed tokens on the busiest expert-parallel rank over the mean (default 1.1)",
    )
    work.add_argument(
        "--moment-bits", type=int, choices=(32, 16), default=32, help="optimizer moments in fp32 or bf16 (16)"
    )
    work.add_argument(
        "--act-cache-bits",
        type=int,
        choices=(16, 8),
        default=16,
        help="8: the fp8 GEMMs' inputs are cached for backward in fp8 (needs --precision fp8)",
    )
    work.add_argument(
        "--mtp-depth",
        type=int,
        default=0,
        help="multi-token-prediction modules trained after the last layer (DeepSeek-V3: 1); transformers builds none, "
        "so adapt's own trainer trains none (default 0)",
    )
    soft = parser.add_argument_group("software the run uses (the time model's assumptions)")
    soft.add_argument(
        "--runtime",
        choices=("torch", "megatron"),
        default="torch",
        help="torch: DTensor TP and torch.distributed.pipelining (adapt, torchtitan); megatron: "
        "hand-written TP collectives (can overlap them), asynchronous pipeline P2P",
    )
    soft.add_argument("--attention-kernel", choices=("flash2", "flash3", "unfused"), default="flash2")
    soft.add_argument(
        "--kernels",
        choices=("fused", "eager"),
        default="fused",
        help="norms, GLU and rotary as fused kernels (adapt's operators) or transformers' eager modules",
    )
    soft.add_argument("--compiled", action="store_true", help="a compiled graph issues the kernels (host cost per op)")
    soft.add_argument(
        "--ep-comm",
        choices=("flat", "forwarded"),
        default="flat",
        help="MoE all-to-all: flat (one copy per routed expert) or forwarded (once per target node, then NVLink: DeepEP)",
    )
    soft.add_argument("--ep-fp8-dispatch", action="store_true", help="tokens quantised to fp8 before the dispatch")
    soft.add_argument(
        "--fp8-scaling",
        choices=("tensorwise", "rowwise", "blockwise"),
        default="tensorwise",
        help="with --precision fp8, the recipe's scales: one per tensor (Transformer Engine), per row, or per block "
        "(1x128 activation tiles, 128x128 weight blocks: DeepSeek-V3)",
    )
    soft.add_argument(
        "--moe-weighted-activation",
        action="store_true",
        help="the routing weight scales the experts' activation, so no expert output is kept for backward",
    )
    parser.add_argument(
        "--fixed", metavar="K=V,...", help="evaluate this layout, e.g. 'tp=8,pp=16,dp=64,zero=1,recompute=none'"
    )
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="measurements of the target machine: GEMM rate, dispatch costs, measured steps, "
        "per-block timings (see parallel_planner.calibration)",
    )
    parser.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    add_json(parser, "the plans")
    parser.add_argument(
        "--no-cache", action="store_true", help="rebuild the model spec instead of reusing a cached one"
    )
    parser.set_defaults(func=run)


# Intake modules whose code shapes a ModelSpec: a cached spec is reused only while they are unchanged.
_INTAKE_MODULES = (
    "model/intake.py",
    "model/structure.py",
    "model/skeleton.py",
    "core/source.py",
    "core/checkpoint.py",
    "core/spec.py",
)


class SpecLoader:
    """The model's spec: a ModelSpec JSON as given, else intake's, cached by checkpoint content.

    Describing a config-only giant costs seconds of torch/transformers start-up; a process that has not
    imported torch (the CLI) leaves that to a worker (``parallel_planner.spec_worker``), sets the planner
    up meanwhile, and never imports torch itself.  The cache (``$ADAPT_CACHE_DIR``, default
    ``~/.cache/adapt/specs``) lets re-planning the same checkpoint skip it; its key covers the config,
    weight headers, flags, transformers version and the intake code itself.
    """

    def __init__(self, args: argparse.Namespace):
        self._spec: ModelSpec | None = None
        self._worker = None
        path = Path(args.source)
        if path.suffix == ".json" and path.is_file():
            try:
                data = json.loads(read_input_text(path))
            except json.JSONDecodeError as err:
                raise BadInput(f"{path}: not readable JSON ({err})") from None
            if isinstance(data, dict) and "schema_version" in data and "blocks" in data:
                self._spec = ModelSpec.from_dict(data)
                return
        from adapt.core.source import resolve_source

        src = resolve_source(
            args.source,
            config_only=args.config_only,
            trust_remote_code=args.trust_remote_code,
            allow_pickle=args.allow_pickle,
        )
        digest = hashlib.sha256(
            f"{src.content_hash()}|seq={args.plan_seq_len}|{metadata.version('transformers')}".encode()
        )
        package = Path(__file__).resolve().parents[2]
        for name in _INTAKE_MODULES:
            digest.update((package / name).read_bytes())
        cache = Path(os.environ.get("ADAPT_CACHE_DIR", Path.home() / ".cache" / "adapt")) / "specs"
        self._cached = cache / f"{digest.hexdigest()[:32]}.json"
        if self._cached.is_file() and not args.no_cache:
            cached = ModelSpec.from_dict(json.loads(self._cached.read_text()))
            # keyed by content: the same checkpoint at another path (or hub id) is this source, not the cached one
            self._spec = dataclasses.replace(cached, source=src.text)
            return
        from parallel_planner.spec_worker import WorkerSpec, describe

        if "torch" in sys.modules:
            self._spec = self._store(describe(src, args.plan_seq_len))
        else:
            self._worker = WorkerSpec(src, args.plan_seq_len)

    def result(self) -> ModelSpec:
        if self._worker is not None:
            worker, self._worker = self._worker, None
            self._spec = self._store(worker.result())
        assert self._spec is not None
        return self._spec

    def cancel(self) -> None:
        if self._worker is not None:
            self._worker.cancel()

    def _store(self, spec: ModelSpec) -> ModelSpec:
        try:
            self._cached.parent.mkdir(parents=True, exist_ok=True)
            partial = self._cached.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(spec.to_json(indent=None))
            partial.replace(self._cached)
        except OSError:
            pass  # a read-only home only costs the next run its speed
        return spec


def run(args: argparse.Namespace) -> int:
    check_plan_flags(args)
    if args.mode == "inference":
        from adapt.app.commands.plan_inference import run_inference_plan

        return run_inference_plan(args, SpecLoader(args))
    if args.concurrency is not None:
        raise BadInput("--concurrency is for --mode inference; training takes --global-batch or --global-batch-tokens")
    spec_loader = SpecLoader(args)  # a cold spec is described in a worker while the planner sets up here
    try:
        cluster, workload, calibration = _cluster_and_workload(args)
    except BaseException:
        spec_loader.cancel()
        raise
    from parallel_planner.search import plan_parallel

    spec = spec_loader.result()
    from parallel_planner.efficiency import Efficiency

    software = Efficiency(
        runtime=args.runtime,
        attention=args.attention_kernel,
        fused_kernels=args.kernels == "fused",
        compiled=args.compiled,
        ep_forwarded=args.ep_comm == "forwarded",
        ep_fp8_dispatch=args.ep_fp8_dispatch,
        moe_weighted_activation=args.moe_weighted_activation,
        fp8_scaling=args.fp8_scaling,
    )
    result = plan_parallel(
        spec, cluster, workload, fixed=args.fixed, top_k=args.top, calibration=calibration, efficiency=software
    )
    if args.fixed and not result.best.fits:
        best = result.best
        raise BadInput(
            f"the fixed layout does not fit: {best.memory_gib_per_gpu:.1f} GiB per GPU needed, "
            f"{best.usable_memory_gib:.1f} GiB usable on {cluster.gpu.name} "
            f"(activations {best.memory_breakdown['activations']:.1f} GiB)"
        )
    if args.json:
        json.dump(result.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    else:
        _print(result, spec)
    return 0


def check_plan_flags(args: argparse.Namespace) -> None:
    """Every plan flag judged before the model is read: one line naming the flag, its value and what is allowed."""
    build(PlanOptions, args)  # the tree's own checks: --plan-seq-len, --global-batch, --precision
    for flag in ("top", "global_batch_tokens", "concurrency", "gpus", "gpus_per_node"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise BadInput(f"--{flag.replace('_', '-')} is {value}; allowed: an integer >= 1")
    if not 0.1 <= args.gpu_memory_utilization <= 1:  # judged in training mode too, where it does not apply
        raise BadInput(f"--gpu-memory-utilization is {args.gpu_memory_utilization}; allowed: a number from 0.1 to 1")
    if args.moe_imbalance < 1:
        raise BadInput(f"--moe-imbalance is {args.moe_imbalance}; allowed: a number >= 1")
    if not 0 <= args.mtp_depth <= 8 or (args.mtp_depth and args.mode != "train"):
        raise BadInput(f"--mtp-depth is {args.mtp_depth}; allowed: 0 to 8, and above 0 only with --mode train")
    if args.act_cache_bits == 8 and args.precision != "fp8":
        raise BadInput(f"--act-cache-bits 8 with --precision {args.precision}; allowed: 8 only with --precision fp8")
    if args.cluster and (args.gpu or args.gpus or args.gpus_per_node):
        raise BadInput(f"--cluster {args.cluster!r} with --gpu/--gpus/--gpus-per-node; allowed: one of the two forms")
    if (args.gpus or args.gpus_per_node) and not args.gpu:
        raise BadInput(f"--gpus {args.gpus} without --gpu; allowed: --gpu TYPE --gpus N, or --cluster NxGPU")
    if args.cluster:
        from parallel_planner.cluster import parse_cluster_option

        parse_cluster_option(args.cluster)
    elif args.gpu and args.gpu != "local":
        from parallel_planner.catalog import GPU_CATALOG, gpu_type

        try:
            gpu_type(args.gpu)
        except BadInput:
            raise BadInput(
                f"--gpu {args.gpu!r} is not in the catalogue; allowed: {', '.join(GPU_CATALOG)} or local"
            ) from None


def _cluster_and_workload(args: argparse.Namespace):
    from adapt.app.clusters import local_cluster
    from parallel_planner.calibration import load_calibration
    from parallel_planner.cluster import make_cluster, parse_cluster_option
    from parallel_planner.search import plan_parallel  # noqa: F401 - imported while a spec worker runs
    from parallel_planner.workload import Workload

    if args.gpu == "local" and not args.cluster:
        cluster = local_cluster()
    elif args.gpu:
        cluster = make_cluster(args.gpu, args.gpus or 8, args.gpus_per_node)
    else:
        cluster = parse_cluster_option(args.cluster or CPU_CLUSTER) or local_cluster()
    options = dict(
        mode=args.mode,
        precision=args.precision,
        optimizer=args.optimizer,
        moe_imbalance=args.moe_imbalance,
        moment_bits=args.moment_bits,
        act_cache_bits=args.act_cache_bits,
        mtp_depth=args.mtp_depth,
    )
    if args.global_batch_tokens:
        workload = Workload.from_tokens(args.plan_seq_len, args.global_batch_tokens, **options)
    else:
        workload = Workload(args.plan_seq_len, args.plan_global_batch, **options)
    calibration = load_calibration(args.calibration) if args.calibration else None
    return cluster, workload, calibration


def _print(result, spec: ModelSpec) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    c = result.cluster
    console.print(
        f"[bold]{spec.source}[/bold] on {c['num_gpus']} x {c['gpu']['name']} ({c['gpus_per_node']}/node): "
        f"{result.searched:,} layouts scored, {result.feasible:,} fit"
        + (f"; fixed {result.fixed}" if result.fixed else "")
    )
    table = Table()
    for col in (
        "#",
        "tp",
        "pp",
        "dp (replicas x shard)",
        "cp",
        "ep",
        "zero",
        "recompute",
        "mbs",
        "vpp/schedule",
        "GiB/GPU",
        "step s",
        "tokens/s",
        "MFU",
        "HFU",
    ):
        table.add_column(col, justify="right")
    for p in result.plans:
        plan = p.plan
        table.add_row(
            str(p.rank),
            str(plan.tp),
            str(plan.pp),
            f"{plan.dp_replicate}x{plan.dp_shard}" if plan.dp_replicate > 1 and plan.dp_shard > 1 else str(plan.dp),
            str(plan.cp),
            str(plan.ep),
            str(plan.zero),
            plan.recompute,
            str(plan.micro_batch),
            f"{plan.vpp} {plan.pp_schedule}" if plan.pp > 1 else "-",
            f"{p.memory_gib_per_gpu:.1f}",
            f"{p.step_time_s:.3f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.mfu:.1%}",
            f"{p.hfu:.1%}",
        )
    console.print(table)
    best = result.best
    console.print(
        "memory of the best plan (GiB, fullest stage): "
        + ", ".join(f"{k} {v:.2f}" for k, v in best.memory_breakdown.items())
        + f" of {best.usable_memory_gib:.1f} usable"
    )
    console.print("step time parts (s): " + ", ".join(f"{k} {v:.4f}" for k, v in best.time_breakdown.items()))
    if best.host_bound:
        console.print(
            "host-bound: the CPU takes longer to issue each micro-batch than the GPU takes to run it "
            f"({best.time_breakdown['host_per_microbatch']:.4f} s vs {best.time_breakdown['gpu_per_microbatch']:.4f} s)"
        )
    console.print(f"binding constraint: {result.binding_constraint}")
    for note in result.notes:
        console.print(f"note: {note}")
    console.print(f"launch: {best.torchrun}")
