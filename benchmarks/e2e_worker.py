"""The worker side of ``benchmarks/e2e.py``: one process per (model, job), which writes one result file.

A job is building the checkpoint, the operators stage (cold or warm) or one variant's training loop; the
parent (``benchmarks/e2e.py``) runs each in its own process (``e2e.py --worker``) so that one variant's crash,
hang or leftover compile state cannot touch the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.gap_sources import gap_sources
from benchmarks.memory_peak import live_at_peak
from benchmarks.shapes import SHAPES, build_checkpoint, load_checkpoint
from benchmarks.step_profile import gemm_time_by_shape, profile_steps

PEAK_FLOPS = 989e12  # H200 dense bf16
# variant -> compile mode override
ADAPT_VARIANTS = {
    "adapt": None,
    "adapt-eager": "none",
    "adapt-whole": "whole",
    "loss-whole": "whole",
    "adapt-cudagraphs": None,  # the plan's compile mode, its graphs replayed as CUDA graphs
    "adapt-selective": None,
    "adapt-selective-loss1g": None,
    "adapt-loss1g": None,
    "adapt-adamw": None,
    "adapt-selective-adamw": None,
    "adapt-inductor-ops": None,
}
# variant -> recompute (operators.recompute), where not "none"
RECOMPUTE_VARIANTS = {
    "adapt-selective": "selective",
    "adapt-selective-loss1g": "selective",
    "adapt-selective-adamw": "selective",
}
# variants whose optimizer is adapt's AdamW kernel (operators.optim.TritonAdamW) instead of torch's fused AdamW
ADAPT_OPTIMIZER_VARIANTS = {"adapt-adamw", "adapt-selective-adamw", "adapt-cudagraphs", "adapt-inductor-ops"}
# variant -> environment its process starts with (set by the parent, so before anything imports ``operators``):
# ``adapt-inductor-ops`` is ``adapt-adamw`` with the kernels registered as ``triton_op`` (operators/kernels/_registration)
VARIANT_ENV = {"adapt-inductor-ops": {"ADAPT_KERNEL_OPS": "inductor"}}
# variants whose compiled graphs replay as CUDA graphs (operators.api.compile_as_planned)
CUDA_GRAPH_VARIANTS = {"adapt-cudagraphs"}
# variant -> the fused loss's logits budget per chunk (bytes), where not the kernel's default
LOSS_BUDGET_VARIANTS = {"adapt-selective-loss1g": 2**30, "adapt-loss1g": 2**30}
LOSS_HEAD_KIND = "lm_head_cross_entropy"


def ops_job(ckpt: Path, plan_path: Path, light: bool) -> dict[str, Any]:
    """The operators stage as ``adapt run`` calls it, after intake (which pays the process's transformers imports);
    its plan is saved for the adapt variants."""
    from adapt.model.intake import build_spec, resolve_source
    from operators import run_ops

    start = time.perf_counter()
    source = resolve_source(str(ckpt))
    spec = build_spec(source)
    intake_seconds = time.perf_counter() - start
    start = time.perf_counter()
    report = run_ops(source, onnx=not light, check_patch=not light, spec=spec)
    seconds = time.perf_counter() - start
    plan_path.write_text(json.dumps(report.plan.to_dict()))
    return {
        "intake_seconds": round(intake_seconds, 2),
        "seconds": round(seconds, 2),
        "phases": {k: round(v, 2) for k, v in report.phases.items()},
        "plan_seconds_by_kind": report.plan.seconds_by_kind,
        "compile": report.plan.compile,
        "patch_check": report.patch_check.passed if report.patch_check is not None and report.patch_check.ran else None,
        "choices": [
            {
                "module": c.module,
                "kind": c.kind,
                "kernel": f"{c.provider}:{c.kernel}",
                "timings_ms": c.timings,
                "margin": c.margin,
            }
            for c in report.plan.components
            if c.timings or c.patch
        ],
    }


def active_params(model) -> tuple[int, int]:
    """(all parameters, parameters a token uses): routed experts count top_k / num_experts of their bank."""
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not experts or not top_k:
        return total, total
    bank = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name or name.endswith(".experts"))
    return total, int(total - bank + bank * top_k / experts)


def flops_per_token(model, seq: int) -> float:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    _, active = active_params(model)
    return 6.0 * active + 6.0 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq


def apply_liger(model_type: str) -> str:
    """Liger's own entry point for this model type (class-level patch, before the model is built)."""
    try:
        import liger_kernel.transformers as liger
    except ImportError as err:
        raise SkipVariant(f"liger_kernel is not importable ({err})") from None
    entry = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
    if entry is None:
        raise SkipVariant(f"Liger has no apply_liger_kernel_to_{model_type}")
    entry()
    return entry.__name__


class SkipVariant(Exception):
    """This variant does not apply to this model (said in the report, not an error)."""


def train_job(args: argparse.Namespace, ckpt: Path, plan_path: Path) -> dict[str, Any]:
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    variant, info = args.variant, {}
    model_type = SHAPES[args.model]["model_type"]
    if variant == "liger":
        info["liger"] = apply_liger(model_type)
    # every variant computes the configured function, as adapt loads it; compile-flex takes transformers'
    # FlexAttention path, which applies a soft-cap and never materialises the scores
    model = load_checkpoint(ckpt, "flex_attention" if variant == "compile-flex" else None).to(device)
    model.train()
    info["attn_implementation"] = model.config._attn_implementation
    if variant in ("compile", "compile-flex"):
        model.compile()
    elif variant == "compile-blocks":
        from adapt.model.blocks import find_blocks

        for block in find_blocks(model):
            block.compile()
    elif variant in ADAPT_VARIANTS:
        from operators import adapt_model
        from operators.mapping import KernelPlan

        plan = KernelPlan.from_dict(json.loads(plan_path.read_text()))
        if variant == "loss-whole":
            plan.components = [c for c in plan.components if c.kind == LOSS_HEAD_KIND]
        if variant in LOSS_BUDGET_VARIANTS:
            from operators.kernels import cross_entropy

            cross_entropy.CHUNK_BUDGET_BYTES = LOSS_BUDGET_VARIANTS[variant]
            info["loss_chunk_budget_bytes"] = cross_entropy.CHUNK_BUDGET_BYTES
        recompute = RECOMPUTE_VARIANTS.get(variant, "none")
        graphs = variant in CUDA_GRAPH_VARIANTS
        handle = adapt_model(model, plan, compile_mode=ADAPT_VARIANTS[variant], recompute=recompute, cuda_graphs=graphs)
        info["patched"] = len(handle.patched)
        info["compile_mode"] = ADAPT_VARIANTS[variant] or plan.compile["mode"]
        if graphs and info["compile_mode"] != "none":
            info["compile_mode"] += ", CUDA graphs"
        info["recompute"] = recompute
        from operators.kernels._registration import MODE

        info["kernel_ops"] = MODE  # what the process registered (the interpreter forces "opaque")
    fused = device == "cuda"
    if variant in ADAPT_OPTIMIZER_VARIANTS:
        from operators.optim import TritonAdamW

        optimizer = TritonAdamW(model.parameters(), lr=args.lr)
        info["optimizer"] = "adapt AdamW (Triton)"
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=fused, foreach=None if fused else True)
        info["optimizer"] = "AdamW fused" if fused else "AdamW foreach"
    gen = torch.Generator().manual_seed(1234)
    batches = [
        torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen).to(device) for _ in range(4)
    ]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def issue(i: int):
        """One step's work, queued: returns the loss without waiting for the device."""
        ids = batches[i % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def step(i: int) -> float:
        return float(issue(i))

    losses, times, host_issue = [], [], []
    started = time.perf_counter()
    first = time.perf_counter()
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        loss = issue(i)
        issued = time.perf_counter() - t0  # the host's own time for the step, before it waits on the device
        losses.append(float(loss))
        if device == "cuda":
            end.record()
            torch.cuda.synchronize()
            elapsed = begin.elapsed_time(end) / 1e3
        else:
            elapsed = time.perf_counter() - t0
        if i == 0:
            first = time.perf_counter() - first
        if i >= args.warmup:
            times.append(elapsed)
            host_issue.append(issued)
        if time.perf_counter() - started > args.variant_budget_s and len(times) >= 3:
            info["stopped_early"] = (
                f"{len(times)} timed steps within the variant budget of {args.variant_budget_s:.0f} s"
            )
            break
    mean = statistics.fmean(times)
    tokens_per_s = args.batch * args.seq / mean
    total, active = active_params(model)
    result = {
        **info,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "steps_timed": len(times),
        "step_s_mean": mean,
        "step_s_median": statistics.median(times),
        "step_s_cv": statistics.pstdev(times) / mean if len(times) > 1 else None,
        "step_s_min": min(times),
        "step_s_max": max(times),
        "host_issue_s_mean": statistics.fmean(host_issue),
        "first_step_s": first,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token(model, args.seq) / PEAK_FLOPS if device == "cuda" else None,
        "params": total,
        "active_params": active,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "losses": losses,
    }
    if device == "cuda":
        from torch._dynamo.utils import counters

        # graphs Inductor compiled for CUDA-graph replay but ran without it (mutated inputs, CPU tensors, ...)
        result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    if args.profile:
        result["profile"] = profile_steps(step, device)
        result["gemm_by_shape"] = gemm_time_by_shape(step, device)
    if args.gaps:
        result["gaps"] = gap_sources(step, device)
    if args.memory and device == "cuda":
        result["memory_at_peak"] = live_at_peak(lambda: issue(0))
    return result


def worker(args: argparse.Namespace) -> int:
    out = Path(args.out)
    ckpt, plan_path = out / "e2e-work" / args.model / "checkpoint", out / "e2e-work" / args.model / "plan.json"
    result_path = out / "e2e-work" / args.model / f"{args.job}.json"
    try:
        if args.job == "checkpoint":
            import torch

            build_checkpoint(
                args.model, ckpt, args.tiny, "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
            )
            result: dict[str, Any] = {"ok": True}
        elif args.job in ("ops-cold", "ops-warm"):
            result = {"ok": True, **ops_job(ckpt, plan_path, args.ops_light)}
        else:
            result = {"ok": True, **train_job(args, ckpt, plan_path)}
    except SkipVariant as why:
        result = {"ok": False, "skipped": str(why)}
    except Exception as err:  # noqa: BLE001 - one variant's failure is a finding of the run, not the end of it
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
    result_path.write_text(json.dumps(result))
    return 0
