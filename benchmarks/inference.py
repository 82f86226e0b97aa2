"""Decode speed and generation alignment on one GPU: HF eager, HF static cache + compile, adapt's decode path.

    PYTHONPATH=$PWD python benchmarks/inference.py --out DIR                 # the H200 run (budget 510 s)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/inference.py --out DIR --tiny   # CPU rehearsal

Two shapes from ``benchmarks/shapes.py`` (``llama-1b``: Llama-3.2-1B; ``gemma2-2b``: Gemma-2-2B), random
weights saved with ``save_pretrained`` and loaded through HF's own loader.  In bf16, a prompt of 512
random tokens and 256 greedy new tokens at batch 1 and 8:

* ``hf-eager``: ``generate()`` with the dynamic cache;
* ``hf-static-compile``: ``generate(cache_implementation="static")``, which transformers compiles;
* ``adapted``: the kernel plan applied, then ``validators.decode.StaticDecoder`` (static cache,
  decode step under ``torch.compile(mode="reduce-overhead")``).

The kernel plan comes from the operators stage run once per shape on the saved checkpoint, so its
kernels are timed on this device.  ``validators.generation.generation_check`` then compares the
adapted model in bf16 with the unadapted one in float32 on the GPU: greedy tokens over 64 new tokens.

Every step runs in its own process.  Compiling dominates the wall time, so the decode variants compile
(warm up) concurrently, at most ``--parallel`` processes at a time (one kernel plan at a time: plans time
kernels), and each then waits; a variant is timed only while no other process works, one at a time.  Whatever does not fit ``--budget-s`` is
stopped and reported as skipped.  The decode targets (``adapt.core.verdicts.DECODE_TARGETS``: adapted
>= 1.0x HF static+compile and >= 3x HF eager, each batch) are judged per shape.  Writes
``inference-h200.{json,md}`` (``inference-tiny.*`` with ``--tiny``) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapt.core.verdicts import DECODE_TARGETS, decode_targets
from benchmarks.shapes import build_checkpoint, load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
INFERENCE_SHAPES = ("llama-1b", "gemma2-2b")  # reference shapes from benchmarks/shapes.py
DECODE_VARIANTS = ("hf-eager", "hf-static-compile", "adapted")
GENERATION_MIN_TOKENS = 64  # greedy tokens the adapted model must match the float32 reference for


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sizes(tiny: bool) -> dict[str, Any]:
    if tiny:
        return {"prompt": 16, "new_tokens": 8, "batches": (1, 2), "repeats": 1, "gen_tokens": 8, "gen_prompts": 2}
    return {"prompt": 512, "new_tokens": 256, "batches": (1, 8), "repeats": 3, "gen_tokens": 64, "gen_prompts": 3}


# Seconds the timed phase of each decode variant takes on the H200 (both batches, repeats, idle profile):
# what the scheduler keeps in hand for it.  Eager decodes at about 25-35 ms a token, the others at 2-5.
MEASURE_S = {"hf-eager": 60.0, "hf-static-compile": 15.0, "adapted": 15.0}


# ---- work done inside one subprocess ----------------------------------------------------------


def make_kernel_plan(path: Path) -> dict[str, Any]:
    """The operators stage on the saved checkpoint (its kernels timed on this device), kept for the other children."""
    from operators import run_ops

    report = run_ops(str(path), onnx=False, check_patch=False)
    (path / "kernel-plan.json").write_text(json.dumps(report.plan.to_dict()))
    patched = [c for c in report.plan.components if c.patch]
    log(f"  kernel plan: {len(patched)} of {len(report.plan.components)} components patched ({report.seconds:.0f} s)")
    return {"patched": len(patched), "components": len(report.plan.components), "ops_s": report.seconds}


def _kernel_plan(path: Path) -> Any:
    from operators.mapping import KernelPlan

    return KernelPlan.from_dict(json.loads((path / "kernel-plan.json").read_text()))  # written by make_kernel_plan


def decode_variant(variant: str, path: Path, tiny: bool, wait_for_go: Any) -> dict[str, Any]:
    """Load, warm every batch (compiling where the variant compiles), wait for the turn to time, then time."""
    import torch

    from validators.decode import warm_hf_generate, warm_static_decoder

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = sizes(tiny)
    started = time.perf_counter()
    model = load_checkpoint(path).to(device).eval()
    notes: list[str] = []
    if variant == "adapted":
        from operators import apply_kernel_plan

        handle = apply_kernel_plan(model, _kernel_plan(path))
        if not handle.patched:
            raise RuntimeError("the kernel plan patched nothing: 'adapted' would be the unmodified model")
        notes.append(f"kernel plan patched {len(handle.patched)} modules")
    vocab = model.get_input_embeddings().num_embeddings
    warm = []
    for batch in size["batches"]:
        ids = torch.randint(0, vocab, (batch, size["prompt"]), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(device)
        if variant == "adapted":
            warm.append(warm_static_decoder(model, ids, size["new_tokens"]))
        else:
            warm.append(warm_hf_generate(model, ids, size["new_tokens"], static=variant == "hf-static-compile"))
    warm_s = time.perf_counter() - started
    log(f"  {variant}: warm in {warm_s:.0f} s, waiting for its turn")
    wait_for_go()
    rows = []
    for item in warm:
        timing = item.measure(variant, size["repeats"])
        timing.notes = notes + timing.notes
        rows.append(timing.to_dict())
        log(f"  {variant} batch {timing.batch}: prefill {timing.prefill_s * 1e3:.1f} ms, "
            f"decode {timing.decode_tokens_per_s:,.0f} tok/s")  # fmt: skip
    return {"rows": rows, "warm_s": warm_s}


def alignment_variant(path: Path, tiny: bool) -> dict[str, Any]:
    import torch

    from adapt.model.intake import resolve_source
    from validators.generation import GenerationOptions, generation_check

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = sizes(tiny)
    options = GenerationOptions(prompts=size["gen_prompts"], prompt_len=32, new_tokens=size["gen_tokens"])
    report = generation_check(
        resolve_source(str(path)), _kernel_plan(path), dtype="bf16", device=device, options=options
    )
    log(f"  generation: {report.outcome}: {report.describe()}")
    return report.to_dict()


def child(args: argparse.Namespace) -> None:
    path, result = Path(args.checkpoint), Path(args.result)

    def wait_for_go() -> None:
        """Say the variant is warm, then block until the orchestrator gives it the machine."""
        result.with_suffix(".ready").write_text("")
        while not result.with_suffix(".go").exists():
            time.sleep(0.05)

    if args.variant == "build":
        import torch

        build_checkpoint(args.shape, path, args.tiny, "cuda" if torch.cuda.is_available() else "cpu")
        data: dict[str, Any] = {"built": str(path)}
    elif args.variant == "plan":
        data = make_kernel_plan(path)
    elif args.variant == "generation":
        data = alignment_variant(path, args.tiny)
    else:
        data = decode_variant(args.variant, path, args.tiny, wait_for_go)
    result.write_text(json.dumps(data))


# ---- the orchestrating process -----------------------------------------------------------------


@dataclass
class Job:
    """One subprocess: a shape's step, the steps it needs first, and where it stands."""

    shape: str
    variant: str
    needs: tuple[str, ...]
    state: str = "pending"  # pending, working, ready (warm, waiting to be timed), timing, done, failed, skipped
    proc: subprocess.Popen | None = None
    started: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def timed(self) -> bool:
        return self.variant in DECODE_VARIANTS

    def files(self, work: Path) -> tuple[Path, Path]:
        stem = work / f"{self.shape}-{self.variant}"
        return stem.with_suffix(".json"), stem.with_suffix(".log")


def jobs_for(shapes: tuple[str, ...]) -> list[Job]:
    """In start order: builds, then per shape the plan and the decode variants, then the generation checks."""
    jobs = [Job(shape, "build", ()) for shape in shapes]
    for shape in shapes:
        jobs += [Job(shape, "plan", ("build",)), Job(shape, "hf-eager", ("build",)),
                 Job(shape, "hf-static-compile", ("build",)), Job(shape, "adapted", ("plan",))]  # fmt: skip
    return jobs + [Job(shape, "generation", ("plan",)) for shape in shapes]


class Scheduler:
    """Runs the jobs: at most ``parallel`` working at once; a warm decode variant is timed alone, when none works."""

    def __init__(self, jobs: list[Job], args: argparse.Namespace, work: Path, deadline: float):
        self.jobs, self.args, self.work, self.deadline = jobs, args, work, deadline

    def run(self, on_change) -> None:
        try:
            while any(j.state in ("pending", "working", "ready", "timing") for j in self.jobs):
                self._poll()
                self._enforce_budget()
                if not any(j.state == "timing" for j in self.jobs):
                    self._start_ready_work()
                    working = [j for j in self.jobs if j.state == "working"]
                    ready = [j for j in self.jobs if j.state == "ready"]
                    if not working and ready:
                        self._go(ready[0])
                on_change()
                time.sleep(0.1)
        finally:
            for job in self.jobs:
                if job.proc is not None and job.proc.poll() is None:
                    job.proc.kill()
                    job.proc.wait()

    def _state(self, shape: str, variant: str) -> str:
        return next((j.state for j in self.jobs if j.shape == shape and j.variant == variant), "done")

    def _start_ready_work(self) -> None:
        for job in self.jobs:
            if sum(j.state == "working" for j in self.jobs) >= self.args.parallel:
                return
            if job.state != "pending":
                continue
            needs = [self._state(job.shape, n) for n in job.needs]
            if any(s in ("failed", "skipped") for s in needs):
                job.state, job.result = "skipped", {"error": f"not run: {' and '.join(job.needs)} did not complete"}
            elif all(s == "done" for s in needs) and self._affordable(job) and not self._other_plan_works(job):
                self._launch(job)
        if not any(j.state in ("working", "ready", "timing") for j in self.jobs):
            for job in (j for j in self.jobs if j.state == "pending"):  # nothing running will free time for it
                job.state, job.result = "skipped", {"error": "not run: it did not fit the time budget"}

    def _other_plan_works(self, job: Job) -> bool:
        """Plans time kernels on the GPU to choose them: two at once would time each other."""
        return job.variant == "plan" and any(j.variant == "plan" and j.state == "working" for j in self.jobs)

    def _affordable(self, job: Job) -> bool:
        """Whether starting ``job`` leaves time to time it and every decode variant already warm or warming."""
        owed = sum(MEASURE_S[j.variant] for j in self.jobs if j.timed and j.state in ("working", "ready"))
        own = MEASURE_S.get(job.variant, 0.0) + 30.0  # its own timing and at least a load
        return self._left() > self._scaled(owed + own)

    def _scaled(self, seconds: float) -> float:
        return seconds / 20 if self.args.tiny else seconds

    def _left(self) -> float:
        return self.deadline - time.perf_counter()

    def _launch(self, job: Job) -> None:
        result, log_file = job.files(self.work)
        cmd = [sys.executable, __file__, "--child", job.variant, "--shape", job.shape,
               "--checkpoint", str(self.work / job.shape), "--result", str(result)]  # fmt: skip
        cmd += ["--tiny"] if self.args.tiny else []
        threads = max(1, (os.cpu_count() or 2) // self.args.parallel)  # Inductor's compile workers per process
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   TORCHINDUCTOR_COMPILE_THREADS=str(threads))  # fmt: skip
        log(f"{job.shape}: {job.variant} starts ({self._left():.0f} s of the budget left)")
        with open(log_file, "w") as out:
            job.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        job.state, job.started = "working", time.perf_counter()

    def _go(self, job: Job) -> None:
        log(f"{job.shape}: timing {job.variant} alone")
        job.files(self.work)[0].with_suffix(".go").write_text("")
        job.state = "timing"

    def _poll(self) -> None:
        for job in self.jobs:
            if job.state not in ("working", "ready", "timing"):
                continue
            result, log_file = job.files(self.work)
            if job.state == "working" and result.with_suffix(".ready").exists():
                job.state = "ready"
            code = job.proc.poll()
            if code is None:
                continue
            seconds = time.perf_counter() - job.started
            if code == 0 and result.exists():
                job.state, job.result = "done", {**json.loads(result.read_text()), "seconds": seconds}
            else:
                tail = log_file.read_text().strip().splitlines()[-6:]
                job.state, job.result = "failed", {"error": f"exit {code}: " + " | ".join(tail), "seconds": seconds}
            log(f"{job.shape}: {job.variant} {job.state} after {seconds:.0f} s")
            sys.stdout.write("".join(f"    {line}\n" for line in log_file.read_text().splitlines()[-8:]))

    def _enforce_budget(self) -> None:
        """Past the point where the warm variants can still be timed, stop what works and skip what waits."""
        owed = sum(MEASURE_S[j.variant] for j in self.jobs if j.timed and j.state in ("ready", "timing"))
        if self._left() > self._scaled(owed) + 5:
            return
        for job in self.jobs:
            if job.state in ("pending", "working") or (job.state in ("ready", "timing") and self._left() < 1):
                if job.proc is not None and job.proc.poll() is None:
                    job.proc.kill()
                    job.proc.wait()
                job.state, job.result = "skipped", {"error": "not run: it did not fit the time budget"}


def orchestrate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "inference-tiny" if args.tiny else "inference-h200"
    started = time.perf_counter()
    shapes = tuple(args.shapes)
    jobs = jobs_for(shapes)
    results: dict[str, Any] = {"sizes": sizes(args.tiny), "budget_s": args.budget_s, "parallel": args.parallel,
                               "environment": environment(), "targets": DECODE_TARGETS}  # fmt: skip
    with tempfile.TemporaryDirectory(dir=args.work) as work_dir:
        seen: list[str] = []

        def on_change() -> None:
            states = [j.state for j in jobs]
            if states != seen:
                seen[:] = states
                collect(results, jobs, time.perf_counter() - started)
                write(out, stem, results)

        Scheduler(jobs, args, Path(work_dir), started + args.budget_s).run(on_change)
    collect(results, jobs, time.perf_counter() - started)
    write(out, stem, results)
    log(f"wrote {out / (stem + '.json')} and {out / (stem + '.md')} after {results['wall_s']:.0f} s")
    return 0


def collect(results: dict[str, Any], jobs: list[Job], wall_s: float) -> None:
    """Results per shape: each step's own, the decode targets' verdicts and the adapted tokens' agreement."""
    on_gpu = results["environment"]["device"] != "cpu"
    results["wall_s"] = wall_s
    results["shapes"] = {}
    for shape in dict.fromkeys(j.shape for j in jobs):
        entry: dict[str, Any] = {j.variant: dict(j.result) for j in jobs if j.shape == shape and j.result}
        rows = [r for v in DECODE_VARIANTS for r in entry.get(v, {}).get("rows", [])]
        entry["targets"] = decode_targets(rows, on_gpu)
        entry["agreement"] = token_agreement(rows)
        for v in DECODE_VARIANTS:  # token lists are for the agreement, not the file
            for row in entry.get(v, {}).get("rows", []):
                row.pop("tokens", None)
        results["shapes"][shape] = entry


def token_agreement(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch and HF path: the greedy steps over which the adapted tokens equal that path's in every sequence."""
    out = []
    for row in (r for r in rows if r["variant"] == "adapted" and r.get("tokens")):
        for other in (r for r in rows if r["batch"] == row["batch"] and r["variant"] != "adapted" and r.get("tokens")):
            same = 0
            for step in range(min(len(row["tokens"][0]), len(other["tokens"][0]))):
                if any(a[step] != b[step] for a, b in zip(row["tokens"], other["tokens"], strict=True)):
                    break
                same += 1
            out.append({"batch": row["batch"], "against": other["variant"], "identical_steps": same,
                        "steps": len(row["tokens"][0])})  # fmt: skip
    return out


def environment() -> dict[str, Any]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}  # fmt: skip


def _rate(entry: dict[str, Any], variant: str, batch: int) -> dict[str, Any] | None:
    rows = entry.get(variant, {}).get("rows") or []
    return next((r for r in rows if r["batch"] == batch), None)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def write(out: Path, stem: str, results: dict[str, Any]) -> None:
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    env, size = results["environment"], results["sizes"]
    targets = ", ".join(f">= {m:g}x {name}" for name, m in results["targets"].items())
    lines = [f"# Decode speed and generation alignment ({env['device']})", "",
             (f"torch {env['torch']}, transformers {env['transformers']}; bf16, prompt {size['prompt']}, "
              f"{size['new_tokens']} new tokens, greedy; decode tokens/s count the tokens after the first (medians "
              f"of {size['repeats']}); each variant in its own process, timed alone. Targets: adapted {targets}, "
              f"at every batch. Wall time {results.get('wall_s', 0):.0f} s of a {results['budget_s']:.0f} s budget."),
             "",
             "| shape | batch | HF eager tok/s | HF static+compile tok/s | adapted tok/s | adapted / static+compile | adapted / eager | verdict | prefill ms (eager / static / adapted) | adapted GPU idle |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |"]  # fmt: skip
    for shape, entry in results["shapes"].items():
        by_batch = {t["batch"]: t for t in entry["targets"]}
        for batch in size["batches"]:
            eager, static, adapted = (_rate(entry, v, batch) for v in DECODE_VARIANTS)
            target = by_batch.get(batch, {})
            tps = [f"{r['decode_tokens_per_s']:,.0f}" if r else "not measured" for r in (eager, static, adapted)]
            prefill = " / ".join(f"{r['prefill_s'] * 1e3:.1f}" if r else "-" for r in (eager, static, adapted))
            idle = adapted.get("gpu_idle_share") if adapted else None
            lines.append(f"| {shape} | {batch} | {' | '.join(tps)} | {_x(target.get('vs_static_compile'))} | "
                         f"{_x(target.get('vs_eager'))} | {target.get('verdict', 'inconclusive')} | {prefill} | "
                         f"{'-' if idle is None else f'{idle:.0%}'} |")  # fmt: skip
    lines += ["", "Verdicts against the targets:", ""]
    for shape, entry in results["shapes"].items():
        lines += [f"- {shape}: {t['reason']}" for t in entry["targets"]] or [f"- {shape}: no decode rate measured"]
    agreement = [(shape, a) for shape, entry in results["shapes"].items() for a in entry["agreement"]]
    if agreement:
        lines += ["", "Adapted greedy tokens against each HF path in bf16 (information: kernels that round "
                  "differently may pick another token at a near-tie):", ""]  # fmt: skip
        lines += [f"- {shape} batch {a['batch']} vs {a['against']}: identical for {a['identical_steps']} of "
                  f"{a['steps']} tokens" for shape, a in agreement]  # fmt: skip
    lines += ["", "## Generation alignment (adapted bf16 against the unadapted model in float32 on the GPU, "
              "float64 on a CPU)", ""]  # fmt: skip
    for shape, entry in results["shapes"].items():
        lines.append(f"- {shape}: {generation_line(entry.get('generation', {}))}")
    errors = [(shape, v, d["error"]) for shape, e in results["shapes"].items() for v, d in e.items()
              if isinstance(d, dict) and "error" in d]  # fmt: skip
    if errors:
        lines += ["", "## Not measured", ""] + [f"- {shape} {variant}: {error}" for shape, variant, error in errors]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def generation_line(gen: dict[str, Any]) -> str:
    """The generation check's verdict, and whether greedy tokens matched the reference for the required length."""
    if "verdict" not in gen:
        return f"not measured: {gen.get('error', 'not run yet')}"
    tokens = next((c for c in gen.get("checks", []) if c["name"] == "tokens"), {})
    enough = gen.get("new_tokens", 0) >= GENERATION_MIN_TOKENS
    met = gen["verdict"] == "passed" and tokens.get("passed") and enough
    return (f"**{gen['verdict']}**; greedy tokens identical to the reference over {gen.get('new_tokens')} new tokens "
            f"(target >= {GENERATION_MIN_TOKENS}, undecidable ties excepted): {'met' if met else 'NOT met'}; "
            f"{gen['summary']}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for inference-h200.{json,md}")
    parser.add_argument("--tiny", action="store_true", help="toy sizes, CPU rehearsal")
    parser.add_argument("--budget-s", type=float, default=510.0, help="total time budget (default 510 s)")
    parser.add_argument("--parallel", type=int, default=4, help="processes building or compiling at once (default 4)")
    parser.add_argument("--shapes", nargs="+", default=list(INFERENCE_SHAPES), choices=INFERENCE_SHAPES)
    parser.add_argument("--work", default=None, help="where the checkpoints go (default: the system temp dir)")
    parser.add_argument("--child", dest="variant", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        try:
            child(args)
        except Exception:  # noqa: BLE001 - the parent records the failure from the exit status and the log
            traceback.print_exc()
            return 1
        return 0
    if not args.out:
        parser.error("--out DIR is required")
    if args.parallel < 1 or args.budget_s <= 0:
        parser.error("--parallel and --budget-s must be positive")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
