"""Distributed realisation on 2 GPUs: bf16 loss parity, tokens/s against the planner, FSDP scaling.

Run on a machine with >= 2 CUDA GPUs, in one call:

    python benchmarks/distributed.py --out benchmarks/results/distributed.json

1. Loss parity at bf16: a 8-block Llama-style model (hidden 512) trains 10 steps on one GPU and
   under FSDP, TP+SP, PP (1F1B) and CP on two; per-step losses are compared (bf16 tolerance).
2. Throughput: the Llama-3.2-1B shape of shared/anchors.md (batch 4 x 2048 per GPU) under each
   2-GPU plan; median tokens/s of the timed steps next to the planner's prediction for that plan.
3. FSDP scaling 1 -> 2 GPUs from the same runs.
Every case runs in its own ``torchrun`` group through ``adapt``'s own trainer (``--worker`` mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LLAMA_1B = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True, "max_position_embeddings": 8192,
}  # fmt: skip
PARITY_MODEL = {
    "model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 4096,
}  # fmt: skip

PARITY_CASES = {
    "parity_1gpu": (1, {}),
    "parity_fsdp": (2, {"dp_shard": 2}),
    "parity_tp_sp": (2, {"tp": 2}),
    "parity_pp_1f1b": (2, {"pp": 2, "grad_accum": 4}),
    "parity_cp": (2, {"cp": 2}),
}
THROUGHPUT_CASES = {
    "tput_1gpu": (1, {"global_batch": 4}),
    "tput_fsdp": (2, {"dp_shard": 2, "global_batch": 8}),
    "tput_tp_sp": (2, {"tp": 2, "global_batch": 8, "grad_accum": 2}),
    "tput_pp_1f1b": (2, {"pp": 2, "global_batch": 8, "grad_accum": 8}),
    "tput_cp": (2, {"cp": 2, "global_batch": 8, "grad_accum": 2}),
}
PARITY_RTOL = 2e-2  # bf16 compute, fp32 reduction and master weights


def write_config(fields: dict, directory: Path) -> Path:
    from transformers import AutoConfig

    fields = dict(fields)
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(directory)
    return directory


def worker(case: str, source: str, out: str, steps: int, seq_len: int) -> None:
    """Inside torchrun: train ``steps`` steps of one case with adapt's trainer and save its metrics."""
    import torch.distributed as dist

    from adapt.runtime.runner import (
        init_distributed,
        load_for_training,
        prepare,
    )
    from adapt.runtime.trainer import TrainConfig, set_determinism
    from parallel_planner.plan import ParallelPlan

    _, overrides = {**PARITY_CASES, **THROUGHPUT_CASES}[case]
    init_distributed()
    set_determinism(
        0, deterministic=False
    )  # same random init in the 1-GPU reference and every layout
    plan = ParallelPlan(
        **{
            "precision": os.environ.get("ADAPT_BENCH_PRECISION", "bf16"),
            "seq_len": seq_len,
            "global_batch": 8,
            **overrides,
        }
    )
    run = prepare(
        load_for_training(source),
        plan,
        TrainConfig(steps=steps, lr=3e-4, warmup_steps=2, seed=0),
    )
    metrics = [run.trainer.train_step().to_dict() for _ in range(steps)]
    if os.environ.get("ADAPT_BENCH_PROFILE"):  # two more steps under the profiler: where the time goes
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                run.trainer.train_step()
        if dist.get_rank() == 0:
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60)
            gpu = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
            Path(out).with_suffix(".profile.txt").write_text(table + "\n\n" + gpu)
    if dist.get_rank() == 0:
        Path(out).write_text(
            json.dumps({"case": case, "plan": plan.to_dict(), "steps": metrics})
        )
    dist.destroy_process_group()


def launch(case: str, source: Path, steps: int, seq_len: int, scratch: Path) -> dict:
    nproc, _ = {**PARITY_CASES, **THROUGHPUT_CASES}[case]
    out = scratch / f"{case}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           "--worker", case, "--source", str(source), "--result", str(out), "--steps", str(steps), "--seq-len", str(seq_len)]  # fmt: skip
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if proc.returncode:
        return {"case": case, "error": proc.stderr[-3000:]}
    return json.loads(out.read_text())


def planner_prediction(source: Path, overrides: dict, seq_len: int) -> float | None:
    from adapt.core.errors import BadInput
    from adapt.model.intake import inspect
    from parallel_planner.cluster import make_cluster
    from parallel_planner.search import plan_parallel
    from parallel_planner.workload import Workload

    fixed = {
        k: v
        for k, v in dict(overrides, dp=overrides.get("dp_shard", 1)).items()
        if k in ("tp", "pp", "cp", "dp")
    }
    world = 1
    for v in fixed.values():
        world *= v
    try:
        result = plan_parallel(
            inspect(str(source)),
            make_cluster("h200", world),
            Workload(seq_len, overrides["global_batch"]),
            fixed=fixed,
            top_k=1,
        )
        return result.plans[0].tokens_per_s
    except (
        BadInput
    ) as err:  # the prediction is reported next to the measurement, never instead of it
        print(f"planner prediction unavailable for {overrides}: {err}", file=sys.stderr)
        return None


def markdown(report: dict) -> str:
    """The committed table: parity per layout, then measured tokens/s next to the planner's figure."""
    lines = [f"# Distributed realisation on 2 x {report['device']} (torch {report['torch']})", "",
             f"Loss parity: the {PARITY_MODEL['num_hidden_layers']}-block, hidden-{PARITY_MODEL['hidden_size']} Llama-style "
             "model, 10 bf16 steps, each layout against the same model on one GPU (tolerance "
             f"{PARITY_RTOL:g} relative).", "", "| layout | max relative loss difference | ok | error |", "| --- | --- | --- | --- |"]
    for case, row in report.get("parity", {}).items():
        lines.append(f"| {case} | {row['max_rel_diff']:.2e} | {row['ok']} | {_last_line(row.get('error'))} |")
    lines += ["", "Throughput: Llama-3.2-1B shape (anchors.md), seq 2048, median of steps 5-12, adapt's trainer (eager).", "",
              "| layout | GPUs | measured tokens/s | planner tokens/s | planner / measured | peak GiB | error |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for case, row in report.get("throughput", {}).items():
        got, want = row.get("tokens_per_s"), row.get("predicted_tokens_per_s")
        ratio = f"{want / got:.2f}" if got and want else "-"
        lines.append(f"| {case} {row['plan']} | {row['gpus']} | {got or 0:,.0f} | {want or 0:,.0f} | {ratio} | "
                     f"{row.get('peak_memory_gib') or 0:.1f} | {_last_line(row.get('error'))} |")
    if report.get("fsdp_scaling_1_to_2"):
        lines += ["", f"FSDP scaling 1 -> 2 GPUs: {report['fsdp_scaling_1_to_2']:.2f}x"]
    return "\n".join(lines) + "\n"


def _last_line(error: str | None) -> str:
    """The exception line of a worker's stderr tail, for a table cell."""
    if not error:
        return ""
    lines = error.splitlines()
    found = [ln for ln in lines if "adapt.core.errors" in ln] or [ln for ln in lines if "Error:" in ln]
    return (found[-1] if found else lines[-1]).replace("|", "/").strip()[:160]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks/results/distributed.json")
    )
    parser.add_argument("--only", choices=("parity", "throughput"), help="run one part")
    parser.add_argument(
        "--steps",
        type=int,
        default=12,
        help="throughput steps (the first 4 are warm-up)",
    )
    parser.add_argument("--profile", nargs="*", metavar="CASE", help="profile these throughput cases (2 steps each)")
    parser.add_argument("--cases", nargs="*", help="throughput cases to run (default: all)")
    parser.add_argument("--render", help="write the Markdown table for an existing result JSON and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=2048, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.render:
        Path(args.render).with_suffix(".md").write_text(markdown(json.loads(Path(args.render).read_text())))
        return 0
    if args.worker:
        worker(args.worker, args.source, args.result, args.steps, args.seq_len)
        return 0
    import torch

    if torch.cuda.device_count() < 2:
        print(
            "benchmarks/distributed.py needs 2 CUDA GPUs (NCCL); found",
            torch.cuda.device_count(),
            file=sys.stderr,
        )
        return 2
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        if args.profile:
            source = write_config(LLAMA_1B, scratch / "llama_1b")
            os.environ["ADAPT_BENCH_PROFILE"] = "1"
            for case in args.profile:
                run = launch(case, source, 6, 2048, scratch)
                prof = scratch / f"{case}.profile.txt"
                text = prof.read_text() if prof.exists() else run.get("error", "no profile written")
                Path(args.out).with_name(f"profile-{case}.txt").write_text(text)
                print(f"== {case}\n{text[:6000]}")
            return 0
        if args.only in (None, "parity"):
            source = write_config(PARITY_MODEL, scratch / "parity_model")
            runs = {c: launch(c, source, 10, 1024, scratch) for c in PARITY_CASES}
            ref = [s["loss"] for s in runs["parity_1gpu"].get("steps", [])]
            report["parity"] = {}
            for case, run in runs.items():
                losses = [s["loss"] for s in run.get("steps", [])]
                worst = max(
                    (abs(a - b) / abs(b) for a, b in zip(losses, ref)),
                    default=float("nan"),
                )
                report["parity"][case] = {"losses": losses, "max_rel_diff": worst, "ok": bool(ref) and worst <= PARITY_RTOL,
                                          "error": run.get("error")}  # fmt: skip
        if args.only in (None, "throughput"):
            source = write_config(LLAMA_1B, scratch / "llama_1b")
            report["throughput"] = {}
            for case, (nproc, overrides) in THROUGHPUT_CASES.items():
                if args.cases and case not in args.cases:
                    continue
                run = launch(case, source, args.steps, 2048, scratch)
                timed = [s["tokens_per_s"] for s in run.get("steps", [])[4:]]
                measured = statistics.median(timed) if timed else None
                report["throughput"][case] = {
                    "gpus": nproc, "plan": overrides, "tokens_per_s": measured,
                    "peak_memory_gib": max((s["peak_memory_gib"] for s in run.get("steps", [])), default=None),
                    "predicted_tokens_per_s": planner_prediction(source, overrides, 2048), "error": run.get("error"),
                }  # fmt: skip
            one, two = (
                report["throughput"].get("tput_1gpu", {}).get("tokens_per_s"),
                report["throughput"].get("tput_fsdp", {}).get("tokens_per_s"),
            )
            report["fsdp_scaling_1_to_2"] = (two / one) if one and two else None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    Path(args.out).with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
