"""The adapted model on 2 GPUs: tokens/s per layout against one GPU and the planner, bf16 loss parity.

Run on a machine with >= 2 CUDA GPUs, in one call (about 8 minutes on 2 x H200):

    python benchmarks/distributed.py --out benchmarks/results/distributed-h200x2.json

The Llama-3.2-1B shape (shared/anchors.md), sequence 2048, bf16, global batch 8 sequences in every
layout: one GPU, FSDP2, TP2+SP, CP2 and PP2 (interleaved 1F1B, 8 micro-batches) on two.  Each
layout is the *adapted* model -- adapt's kernel plan (made once on GPU 0 by the operators stage's
own functions, the same for every rank) and each block compiled with Inductor, applied per chunk
in torchtitan's order (``adapt.runtime.adapted``); async TP where torch has it.
``--layouts`` reruns a subset (the 1-GPU reference always runs); ``--no-async-tp``,
``--kernel-regions opaque`` and ``--no-kernels`` isolate a failure; ``--no-kernels --backend eager`` runs
transformers' own modules uncompiled, as ``distributed-h200x2.json``'s throughput cases ran, so the profiled host
and GPU time per step say which of those layouts the host paced (``planner-measured.md``).  The realised plan is the planner's own choice for that layout (micro-batch size and count,
recompute, schedule), so measured and predicted tokens/s refer to the same plan.

Every layout runs 12 steps in its own ``torchrun`` group through adapt's trainer, from the same
seeded initialisation on the same batches: the first 10 losses are compared with the one-GPU run
(bf16 parity), tokens/s is the median of steps 5-12, then 2 more steps run under the profiler for
host (CPU) time per step -- CPU self time of every op and runtime call except synchronisation
and copies that wait on the GPU -- next to GPU busy time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LLAMA_1B = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True, "max_position_embeddings": 8192,
}  # fmt: skip
SEQ_LEN, GLOBAL_BATCH, STEPS, PARITY_STEPS, WARMUP = 2048, 8, 12, 10, 4
# layout -> (GPUs, knobs pinned for the planner, the plan used if the planner cannot answer)
LAYOUTS = {
    "1 GPU": (1, {"tp": 1, "pp": 1, "dp": 1, "cp": 1}, {"grad_accum": 2, "micro_batch": 4}),
    "FSDP2": (2, {"tp": 1, "pp": 1, "dp": 2, "cp": 1}, {"dp_shard": 2, "micro_batch": 4}),
    "TP2+SP": (2, {"tp": 2, "pp": 1, "dp": 1, "cp": 1}, {"tp": 2, "grad_accum": 2, "micro_batch": 4}),
    "CP2": (2, {"tp": 1, "pp": 1, "dp": 1, "cp": 2}, {"cp": 2, "grad_accum": 2, "micro_batch": 4}),
    "PP2": (2, {"tp": 1, "pp": 2, "dp": 1, "cp": 1, "mbs": 1, "vpp": 2, "schedule": "interleaved_1f1b"},
            {"pp": 2, "vpp": 2, "pp_schedule": "interleaved_1f1b", "grad_accum": 8}),
}  # fmt: skip
PARITY_RTOL = 5e-3  # bf16 compute, fp32 reduction and master weights; measured eager layouts differ by 2e-5
WAITS = ("Synchronize", "cudaMemcpy", "aten::_local_scalar_dense", "aten::item")


def write_config(fields: dict, directory: Path) -> Path:
    from transformers import AutoConfig

    fields = dict(fields)
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(directory)
    return directory


def make_kernel_plan(source: Path, path: Path) -> float:
    """The operators stage's kernel plan for the model, made once on GPU 0 and pickled for every worker;
    returns the seconds it took."""
    import pickle

    import torch

    from adapt.runtime.runner import load_for_training
    from operators import load_profile, plan_kernels, recognise
    from operators.inventory import trace_model
    from operators.registry import Target

    started = time.perf_counter()
    torch.manual_seed(0)
    model = load_for_training(str(source)).to("cuda")
    inventory = trace_model(model)
    plan = plan_kernels(
        inventory, recognise(model, inventory), load_profile("cuda-hopper"), Target.here(dtype="bfloat16")
    )
    path.write_bytes(pickle.dumps(plan))
    del model, inventory
    torch.cuda.empty_cache()
    return time.perf_counter() - started


def host_and_gpu_ms(prof, steps: int) -> tuple[float, float]:
    """Per step: CPU self time outside GPU waits, and GPU kernel time (from one profiler window)."""
    host = gpu = 0.0
    for event in prof.key_averages():
        if not any(w in event.key for w in WAITS):
            host += event.self_cpu_time_total
        gpu += getattr(event, "self_device_time_total", 0.0)
    return host / 1e3 / steps, gpu / 1e3 / steps


def worker(layout: str, plan_json: str, source: str, out: str, args: argparse.Namespace) -> None:
    """Inside torchrun: realise the plan on the adapted model, train, profile; rank 0 writes the figures."""
    import pickle

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from adapt.runtime.adapted import AdaptOptions
    from adapt.runtime.runner import (
        init_distributed,
        load_for_training,
        prepare,
    )
    from adapt.runtime.trainer import TrainConfig, set_determinism
    from parallel_planner.plan import ParallelPlan

    device = init_distributed()
    set_determinism(0, deterministic=False)  # the same initialisation in every layout
    plan = ParallelPlan(**json.loads(plan_json))
    started = time.perf_counter()
    model = load_for_training(source).to(device)
    kernel_plan = pickle.loads(Path(args.kernel_plan).read_bytes()) if args.kernel_plan else None
    planned_s = time.perf_counter() - started
    compile_backend = None if args.backend == "eager" else args.backend
    adapt = AdaptOptions(kernel_plan=kernel_plan, compile=compile_backend, kernel_regions=args.kernel_regions,
                         async_tp=args.async_tp)  # fmt: skip
    run = prepare(model, plan, TrainConfig(steps=STEPS + 2, lr=3e-4, warmup_steps=2, seed=0), adapt=adapt)
    steps = [run.trainer.train_step().to_dict() for _ in range(STEPS)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            run.trainer.train_step()
    host_ms, gpu_ms = host_and_gpu_ms(prof, 2)
    mine = {"host_ms": host_ms, "gpu_ms": gpu_ms, "peak_gib": max(s["peak_memory_gib"] for s in steps)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        result = {"layout": layout, "plan": plan.to_dict(), "steps": steps, "ranks": everyone,
                  "adapted": run.pmodel.adapted.to_dict(), "setup_s": planned_s}  # fmt: skip
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def planner_plan(source: Path, layout: str) -> tuple[dict, float | None, str]:
    """(plan fields, predicted tokens/s, note): the planner's plan for the layout's pinned knobs."""
    from adapt.model.intake import inspect
    from parallel_planner.cluster import make_cluster
    from parallel_planner.search import plan_parallel
    from parallel_planner.workload import Workload

    gpus, pinned, fallback = LAYOUTS[layout]
    try:
        result = plan_parallel(inspect(str(source)), make_cluster("h200", gpus), Workload(SEQ_LEN, GLOBAL_BATCH),
                               fixed={**pinned, "offload": 0}, top_k=1)  # fmt: skip
        best = result.plans[0]
        fields = {**best.plan.to_dict(), "precision": "bf16", "seq_len": SEQ_LEN, "global_batch": GLOBAL_BATCH}
        return fields, best.tokens_per_s, ""
    except Exception as err:  # noqa: BLE001 -- a planner failure costs the prediction, never the measurement
        fields = {"precision": "bf16", "seq_len": SEQ_LEN, "global_batch": GLOBAL_BATCH, **fallback}
        return fields, None, f"planner unavailable ({type(err).__name__}: {str(err)[:100]}); default plan"


def launch(layout: str, plan: dict, source: Path, scratch: Path, args: argparse.Namespace, timeout: float) -> dict:
    gpus = LAYOUTS[layout][0]
    out = scratch / f"{layout.replace(' ', '_').replace('+', '')}.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        __file__,
        "--worker",
        layout,
        "--plan",
        json.dumps(plan),
        "--source",
        str(source),
        "--result",
        str(out),
        "--kernel-regions",
        args.kernel_regions,
        "--backend",
        args.backend,
    ]
    cmd += ["--kernel-plan", str(scratch / "kernel_plan.pkl")] if args.kernels else []
    cmd += [] if args.async_tp else ["--no-async-tp"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_VERBOSITY": "error"}
    # Its own session: on timeout the whole group (torchrun and its workers) goes, freeing the GPUs.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode or not out.exists():
        return {"error": stderr[-3000:] or f"exit {proc.returncode}"}
    return json.loads(out.read_text())


def summarise(layout: str, run: dict, predicted: float | None, note: str) -> dict:
    steps = run.get("steps", [])
    timed = [s["tokens_per_s"] for s in steps[WARMUP:]]
    ranks = run.get("ranks", [])
    return {
        "gpus": LAYOUTS[layout][0], "plan": run.get("plan"), "tokens_per_s": statistics.median(timed) if timed else None,
        "predicted_tokens_per_s": predicted, "peak_memory_gib": max((r["peak_gib"] for r in ranks), default=None),
        "host_ms_per_step": max((r["host_ms"] for r in ranks), default=None),
        "gpu_ms_per_step": max((r["gpu_ms"] for r in ranks), default=None),
        "step_ms": statistics.median(s["step_time_s"] for s in steps[WARMUP:]) * 1e3 if timed else None,
        "losses": [s["loss"] for s in steps[:PARITY_STEPS]], "adapted": run.get("adapted"),
        "setup_s": run.get("setup_s"), "note": note, "error": run.get("error"),
    }  # fmt: skip


def markdown(report: dict) -> str:
    """The committed table: measured against one GPU and the planner, host time, parity."""
    lines = [f"# The adapted model on 2 x {report['device']} (torch {report['torch']})", "",
             (f"Llama-3.2-1B shape, seq {SEQ_LEN}, bf16, global batch {GLOBAL_BATCH} in every layout; adapt's kernel plan "
              f"({'on' if report['kernels'] else 'off'}) and per-block compilation ({report.get('backend', 'inductor')}); "
              f"median tokens/s of steps {WARMUP + 1}-{STEPS}; parity: max relative loss difference over {PARITY_STEPS} "
              f"steps against 1 GPU (tolerance {PARITY_RTOL:g}); host ms: CPU self time per step outside GPU waits "
              "(profiler)."), "",
             "| layout | plan | tokens/s | x 1 GPU | planner tokens/s | planner / measured | peak GiB | host ms/step | GPU ms/step | parity | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for layout, row in report["layouts"].items():
        got, want, scale = row.get("tokens_per_s"), row.get("predicted_tokens_per_s"), row.get("scaling")
        plan = row.get("plan") or {}
        knobs = ", ".join(f"{k}={plan[k]}" for k in ("tp", "pp", "vpp", "dp_shard", "cp", "micro_batch", "grad_accum", "recompute", "pp_schedule")
                          if k in plan and plan[k] not in (1, "none") or k in ("micro_batch", "grad_accum") and k in plan)  # fmt: skip
        parity = row.get("parity") or {}
        cells = [layout, knobs, f"{got:,.0f}" if got else "-", f"{scale:.2f}" if scale else "-", f"{want:,.0f}" if want else "-",
                 f"{want / got:.2f}" if got and want else "-", _num(row.get("peak_memory_gib")), _num(row.get("host_ms_per_step")),
                 _num(row.get("gpu_ms_per_step")), f"{parity.get('max_rel_diff', float('nan')):.1e} {'ok' if parity.get('ok') else 'FAIL'}",
                 _last_line(row.get("error")) or row.get("note", "")]  # fmt: skip
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _num(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def _last_line(error: str | None) -> str:
    """The exception line of a worker's stderr tail, for a table cell."""
    if not error:
        return ""
    lines = error.splitlines()
    found = [ln for ln in lines if "adapt.core.errors" in ln] or [ln for ln in lines if "Error:" in ln]
    return (found[-1] if found else lines[-1]).strip()[:160]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/distributed-h200x2.json"))
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), help="default: all (1 GPU always runs first)")
    parser.add_argument(
        "--no-kernels", dest="kernels", action="store_false", help="compiled blocks without the kernel plan"
    )
    parser.add_argument(
        "--kernel-regions",
        default="auto",
        choices=("auto", "inline", "opaque"),
        help="patched modules inside the compiled graph (inline) or outside it (opaque)",
    )
    parser.add_argument(
        "--backend",
        default="inductor",
        choices=("inductor", "aot_eager", "eager"),
        help="torch.compile backend per block; eager: no compilation (with --no-kernels: transformers' own modules)",
    )
    parser.add_argument(
        "--no-async-tp", dest="async_tp", action="store_false", help="TP without Inductor's micro-pipelining"
    )
    parser.add_argument(
        "--budget-s", type=float, default=530, help="total wall-clock budget; later layouts are skipped"
    )
    parser.add_argument("--render", help="write the Markdown table for an existing result JSON and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--kernel-plan", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.render:
        Path(args.render).with_suffix(".md").write_text(markdown(json.loads(Path(args.render).read_text())))
        return 0
    if args.worker:
        worker(args.worker, args.plan, args.source, args.result, args)
        return 0
    import torch

    if torch.cuda.device_count() < 2:
        print(f"benchmarks/distributed.py needs 2 CUDA GPUs (NCCL); found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "kernels": args.kernels,
                    "backend": args.backend, "async_tp": args.async_tp, "layouts": {}}  # fmt: skip
    chosen = ["1 GPU"] + [name for name in (args.layouts or LAYOUTS) if name != "1 GPU"]
    with tempfile.TemporaryDirectory() as tmp:
        source = write_config(LLAMA_1B, Path(tmp) / "llama_1b")
        if args.kernels:
            report["kernel_plan_s"] = make_kernel_plan(source, Path(tmp) / "kernel_plan.pkl")
            print(f"kernel plan made in {report['kernel_plan_s']:.0f} s", flush=True)
        for layout in chosen:
            left = args.budget_s - (time.perf_counter() - start)
            if left < 60:
                report["layouts"][layout] = {"gpus": LAYOUTS[layout][0], "error": "not run: time budget spent"}
                continue
            plan, predicted, note = planner_plan(source, layout)
            print(f"== {layout}: {plan} ({time.perf_counter() - start:.0f} s)", flush=True)
            run = launch(layout, plan, source, Path(tmp), args, min(left, 240))
            report["layouts"][layout] = summarise(layout, run, predicted, note)
            row = report["layouts"][layout]
            print(
                f"   tokens/s {row['tokens_per_s']}, host ms {row['host_ms_per_step']}, error {_last_line(row['error'])}",
                flush=True,
            )
    one = report["layouts"]["1 GPU"]
    for row in report["layouts"].values():
        if one.get("tokens_per_s") and row.get("tokens_per_s"):
            row["scaling"] = row["tokens_per_s"] / one["tokens_per_s"]
        if one.get("losses") and row.get("losses"):
            worst = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], one["losses"]))
            row["parity"] = {"max_rel_diff": worst, "ok": len(row["losses"]) == PARITY_STEPS and worst <= PARITY_RTOL}
    report["wall_s"] = time.perf_counter() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    Path(args.out).with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
