"""Host (CPU) time per training step under each layout, eager against compiled blocks, on CPU with gloo.

    python benchmarks/host_overhead.py --out benchmarks/results/host-overhead-cpu.json

The model is a tiny Llama (hidden 128, 4 blocks, sequence 64) so that arithmetic is negligible and
a step's CPU time is what the framework spends around it: module hooks, DTensor dispatch and
sharding propagation, FSDP's bookkeeping, the pipeline schedule.  Every layout runs in its own
``torchrun`` group of 1 or 2 gloo processes with one thread each, through adapt's own trainer.
"Compiled" compiles each block in place with the ``aot_eager`` backend (``AdaptOptions``): DTensor
dispatch is paid once at trace time and the block runs as one aten graph; Inductor needs a C++
toolchain on CPU, so the GPU run measures it.  The kernel plan is off here: Triton's CPU interpreter
would dominate the time.  Context parallelism needs CUDA (ring attention) and is reported refused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY_LLAMA = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False, "max_position_embeddings": 256,
}  # fmt: skip
SEQ_LEN, GLOBAL_BATCH = 64, 8
LAYOUTS = {  # name -> (processes, plan overrides)
    "1 rank": (1, {}),
    "FSDP2": (2, {"dp_shard": 2}),
    "TP2+SP": (2, {"tp": 2, "sequence_parallel": True}),
    "CP2": (2, {"cp": 2}),
    "PP2 1F1B": (2, {"pp": 2, "grad_accum": 8, "pp_schedule": "1f1b"}),
    "PP2 interleaved": (2, {"pp": 2, "vpp": 2, "grad_accum": 8, "pp_schedule": "interleaved_1f1b"}),
}
MODES = ("eager", "compiled")


def worker(layout: str, mode: str, source: str, out: str, steps: int, warmup: int) -> None:
    """Inside torchrun: time ``warmup + steps`` training steps; rank 0 writes every rank's figures."""
    import torch
    import torch.distributed as dist

    from adapt.runtime.adapted import AdaptOptions
    from adapt.runtime.runner import (
        init_distributed,
        load_for_training,
        prepare,
    )
    from adapt.runtime.trainer import TrainConfig, set_determinism
    from parallel_planner.plan import ParallelPlan

    torch.set_num_threads(1)
    init_distributed()
    set_determinism(0, deterministic=False)
    plan = ParallelPlan(precision="fp32", seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, **LAYOUTS[layout][1])
    adapt = AdaptOptions(compile="aot_eager") if mode == "compiled" else None
    run = prepare(load_for_training(source), plan, TrainConfig(steps=steps + warmup, seed=0), adapt=adapt)
    cpu, wall, losses = [], [], []
    for index in range(warmup + steps):
        dist.barrier()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        metrics = run.trainer.train_step()
        if index >= warmup:
            cpu.append(time.process_time() - cpu0)
            wall.append(time.perf_counter() - wall0)
        losses.append(metrics.loss)
    mine = {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall), "losses": losses}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"ranks": everyone, "compiled_blocks": run.pmodel.adapted.compiled_blocks}))
    dist.destroy_process_group()


def launch(layout: str, mode: str, source: Path, args: argparse.Namespace, scratch: Path) -> dict:
    nproc = LAYOUTS[layout][0]
    out = scratch / f"{layout.replace(' ', '_')}-{mode}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           "--worker", layout, "--mode", mode, "--source", str(source), "--result", str(out),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, timeout=args.case_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.case_timeout} s"}
    if proc.returncode or not out.exists():
        return {"error": _reason(proc.stderr) or f"exit {proc.returncode}"}
    result = json.loads(out.read_text())
    return {
        "cpu_ms_per_step": 1e3 * max(r["cpu_s"] for r in result["ranks"]),
        "wall_ms_per_step": 1e3 * max(r["wall_s"] for r in result["ranks"]),
        "losses": result["ranks"][0]["losses"],
        "compiled_blocks": result["compiled_blocks"],
    }


def _reason(stderr: str) -> str:
    """The worker's own exception line (adapt's BadInput first), not torchrun's summary."""
    lines = [ln.split("]:", 1)[-1].strip() for ln in stderr.splitlines()]
    found = [ln for ln in lines if "BadInput" in ln] or [
        ln for ln in lines if "Error" in ln and "ChildFailedError" not in ln
    ]
    return found[-1][:200] if found else ""


def markdown(report: dict) -> str:
    lines = [
        f"# Host time per training step on CPU (gloo, torch {report['torch']})", "",
        (f"Tiny Llama (hidden {TINY_LLAMA['hidden_size']}, {TINY_LLAMA['num_hidden_layers']} blocks, seq {SEQ_LEN}, "
         f"global batch {GLOBAL_BATCH}, fp32), one thread per process, median of {report['steps']} steps after "
         f"{report['warmup']} warm-up steps; the slowest rank.  Compiled: each block `torch.compile`d in place "
         "(aot_eager backend), so the arithmetic is the same and the difference is host overhead."), "",
        "| layout | processes | eager CPU ms/step | compiled CPU ms/step | eager / compiled | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for layout, row in report["layouts"].items():
        eager, compiled = row.get("eager", {}), row.get("compiled", {})
        e, c = eager.get("cpu_ms_per_step"), compiled.get("cpu_ms_per_step")
        note = eager.get("error") or compiled.get("error") or ""
        ratio = f"{e / c:.2f}x" if e and c else "-"
        cells = [
            layout,
            LAYOUTS[layout][0],
            f"{e:.1f}" if e else "-",
            f"{c:.1f}" if c else "-",
            ratio,
            note.replace("|", "/"),
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    for note in report.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/host-overhead-cpu.json"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), help="default: all")
    parser.add_argument("--case-timeout", type=int, default=300)
    parser.add_argument("--render", help="rewrite the Markdown of an existing result JSON and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.render:
        Path(args.render).with_suffix(".md").write_text(markdown(json.loads(Path(args.render).read_text())))
        return 0
    if args.worker:
        worker(args.worker, args.mode, args.source, args.result, args.steps, args.warmup)
        return 0
    import torch
    from transformers import AutoConfig

    report: dict = {"torch": torch.__version__, "steps": args.steps, "warmup": args.warmup, "layouts": {}}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        fields = dict(TINY_LLAMA)
        source = Path(tmp) / "tiny_llama"
        AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(source)
        for layout in args.layouts or LAYOUTS:
            report["layouts"][layout] = {}
            for mode in MODES:
                row = launch(layout, mode, source, args, Path(tmp))
                report["layouts"][layout][mode] = row
                print(f"{layout:>16} {mode:>8}: {row.get('cpu_ms_per_step', 0):8.1f} ms CPU/step "
                      f"{row.get('error', '')} ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    Path(args.out).with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
