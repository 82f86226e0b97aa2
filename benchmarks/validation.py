"""Validation stages on one GPU at the Llama-3.2-1B shape: environment, bf16 alignment, bench, 500-step soak.

    PYTHONPATH=$PWD python benchmarks/validation.py --out DIR            # on the H200
    PYTHONPATH=$PWD python benchmarks/validation.py --out DIR --tiny     # CPU rehearsal at tiny width

The checkpoint is a random-init ``LlamaConfig`` of the anchors' shape (hidden 2048, ffn 8192, 16
layers, 32/8 heads, vocab 128256, tied), saved with ``save_pretrained`` so every stage loads it
through HF's own loader.  Writes ``validation-h200.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

LLAMA_1B = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True, "max_position_embeddings": 8192,
}
TINY = {
    "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 512,
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_checkpoint(path: Path, shape: dict, device: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    return path


class StageTimeout(Exception):
    pass


def _alarm(_signum, _frame):
    raise StageTimeout("stage ran past its time limit")


def stage(results: dict, name: str, fn, out: Path, limit_s: int = 0):
    """Run one stage; record its result or its error, and write the files so far (a later kill loses nothing)."""
    start = time.perf_counter()
    log(f"{name} ...")
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit_s)
    try:
        results[name] = fn()
    except Exception as err:  # noqa: BLE001 - one stage failing must not lose the others' figures
        results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        signal.alarm(0)
    results[name]["wall_s"] = time.perf_counter() - start
    log(f"{name} done in {results[name]['wall_s']:.1f}s")
    (out / "validation-h200.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "validation-h200.md").write_text(render_markdown(results))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal at tiny width")
    parser.add_argument("--soak-steps", type=int, default=500)
    parser.add_argument("--skip", nargs="*", default=[], help="stages to skip: env ops align bench soak")
    parser.add_argument("--ops-limit", type=int, default=240, help="seconds allowed for the operators stage")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.tiny else "cuda"
    shape = TINY if args.tiny else LLAMA_1B
    bench_seq, bench_batch = (64, 2) if args.tiny else (2048, 4)
    soak_seq, soak_batch = (32, 2) if args.tiny else (256, 4)

    from adapt.intake import resolve_source
    from validators.align import AlignOptions, align
    from validators.environment import check_environment
    from validators.soak import soak
    from validators.throughput import BenchOptions, bench

    results: dict = {"shape": shape, "device": device, "argv": sys.argv[1:]}
    start = time.perf_counter()
    ckpt = make_checkpoint(Path(os.environ.get("TMPDIR", "/tmp")) / "llama-1b-shape", shape, device)
    src = resolve_source(str(ckpt))
    log(f"checkpoint written in {time.perf_counter() - start:.1f}s")
    if "env" not in args.skip:
        stage(results, "environment", lambda: check_environment(precision="bf16", device=device).to_dict(), out)
    plan = None
    if "ops" not in args.skip:
        def ops():
            nonlocal plan
            from operators import run_ops

            report = run_ops(src, onnx=False, check_patch=False)
            plan = report.plan
            reused = sum("probed on" in c.evidence for c in report.recognition.components)
            return {"components": [{"module": c.module, "kind": c.kind, "status": c.status, "patch": c.patch} for c in plan.components],
                    "run_ops_s": report.seconds, "trace_s": report.inventory.seconds, "probe_verdicts_reused": reused}

        stage(results, "operators", ops, out, limit_s=args.ops_limit)
    if "align" not in args.skip:
        options = AlignOptions(batch=2, seq_len=64, parity_steps=3, reference_dtype="fp32")
        stage(results, "alignment", lambda: align(src, plan, dtype="bf16", device=device, options=options).to_dict(), out)
    if "bench" not in args.skip:
        options = BenchOptions(dtype="bf16", seq_len=bench_seq, batch=bench_batch, steps=5, warmup=2, decode_tokens=16)
        stage(results, "bench", lambda: bench(src, plan, device=device, options=options).to_dict(), out)
    if "soak" not in args.skip:
        stage(results, "soak", lambda: _soak(soak, src, plan, device, args.soak_steps, soak_seq, soak_batch), out)
    print(render_markdown(results))
    return 0


def _soak(soak, src, plan, device, steps, seq, batch) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as ckpt_dir:
        report = soak(src, plan, steps=steps, ckpt_every=steps // 2, device=device, dtype="bf16", seq_len=seq,
                      batch_size=batch, ckpt_dir=ckpt_dir, deterministic=False).to_dict()
    report["step_time_s"] = [s["step_time_s"] for s in report["steps"]]
    report["allocated_bytes"] = [s["allocated_bytes"] for s in report["steps"]]
    report["reserved_bytes"] = [s["reserved_bytes"] for s in report["steps"]]
    report["grad_norms"] = [s["grad_norm"] for s in report["steps"]]
    report.pop("steps")
    return report


def render_markdown(r: dict) -> str:
    lines = [f"# Validation at the Llama-3.2-1B shape on {r['device']}", "", f"Shape: `{json.dumps(r['shape'])}`", ""]
    env = r.get("environment", {})
    if "versions" in env:
        lines += [f"Versions: `{json.dumps(env['versions'])}`", "",
                  (f"Devices: {', '.join(d['name'] + ' sm_' + d['capability'] for d in env['devices']) or 'none'}; "
                  f"copy {env['copy_gbps']:.0f} GB/s, {env['matmul_dtype']} matmul {env['matmul_tflops']:.1f} TFLOP/s; "
                  + (f"NCCL all-reduce {env['allreduce_gbps']:.0f} GB/s bus bandwidth; " if env.get("allreduce_gbps") else "") +
                  f"problems: {env['problems'] or 'none'}; not checked: {env['unchecked'] or 'nothing'}"), ""]
    ops = r.get("operators", {})
    if "components" in ops:
        patched = [c for c in ops["components"] if c["patch"]]
        lines += [f"Kernel plan: {len(patched)} of {len(ops['components'])} components patched", ""]
    al = r.get("alignment", {})
    if "layers" in al:
        worst = max(al["layers"], key=lambda l: l["rel_err"] or 0)
        grads = al["gradients"]
        lines += ["## Alignment (bf16 candidate on the device vs CPU reference)", "",
                  (f"reference {al['reference_dtype']}; passed **{al['passed']}**; first divergent: {al['first_divergent']}; "
                  f"{sum(l['passed'] for l in al['layers'])}/{len(al['layers'])} tensors and "
                  f"{sum(g['passed'] for g in grads)}/{len(grads)} gradients within limits; worst tensor {worst['name']} "
                  f"rel_err {worst['rel_err']:.3g} (cosine {worst['cosine']:.6f}, err_ratio {worst['err_ratio']:.3g})"), ""]
        logits = next((l for l in al["layers"] if l["name"] == "logits"), None)
        if logits:
            lines.append(f"logits: cosine {logits['cosine']:.6f}, rel_err {logits['rel_err']:.3g}, err_ratio {logits['err_ratio']:.3g}")
        if al.get("parity"):
            p = al["parity"]
            lines.append(f"loss parity over {p['steps']} steps: max relative difference {p['max_rel_diff']:.3g} (tolerance {p['tolerance']})")
        lines += [f"notes: {al['notes']}", ""]
    be = r.get("bench", {})
    if "variants" in be:
        lines += ["## Throughput", "", (f"{be['device_name']}, {be['dtype']}, batch {be['batch']} x {be['seq_len']} tokens, "
                  f"peak {be['peak_flops'] / 1e12:.0f} TFLOP/s ({be['peak_flops_basis']}), train FLOPs/token {be['train_flops_per_token']:.4g}"), "",
                  "| variant | train tokens/s | MFU | prefill tokens/s | decode tokens/s | peak memory GiB |", "| --- | --- | --- | --- | --- | --- |"]
        for v in be["variants"]:
            lines.append(f"| {v['name']} | {v['train_tokens_per_s']:,.0f} | {v['mfu'] * 100:.1f}% | {v['prefill_tokens_per_s']:,.0f} | "
                         f"{v['decode_tokens_per_s']:,.0f} | {v['peak_memory_bytes'] / 2**30:.1f} |")
        lines += ["", f"notes: {be['notes']}", ""]
    so = r.get("soak", {})
    if "losses" in so:
        losses = so["losses"]
        lines += ["## Soak", "", (f"{so['steps_done']}/{so['steps_planned']} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                  f"finite {so['loss_finite']}, step-time CV {so['step_time_cv']:.3f}, drift {so['step_time_drift']:.3f}, "
                  f"memory slope {so['memory_slope_bytes_per_step']:.1f} B/step, leak {so['leak']}, checkpoints at {so['checkpoints']}; "
                  f"passed **{so['passed']}**"), ""]
    for name in ("environment", "operators", "alignment", "bench", "soak"):
        if "error" in r.get(name, {}):
            lines += [f"**{name} failed**: {r[name]['error']}", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
