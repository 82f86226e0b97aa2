"""The fused linear + cross-entropy's cost by chunk size, and where it goes: the evidence for its chunking rule.

    python benchmarks/flce_chunks.py OUT.json            # on a GPU; also writes OUT.md
    python benchmarks/flce_chunks.py --render OUT.json   # the table again from a saved JSON (no GPU)

For each head shape (tokens x hidden x vocab of the e2e models) and each chunk height, it times the whole
operator's forward + backward (``operators.kernels.fused_linear_cross_entropy``, which makes every gradient in
its forward pass) and the three GEMMs one chunk runs: the logits ``[c, H] @ [H, V]``, the input gradient
``[c, V] @ [V, H]`` and the accumulating weight gradient ``dW += [V, c] @ [c, H]``.  The reference row is the
same three GEMMs at full height (what an unchunked head, e.g. ``torch.compile``'s, runs), with its transient
logits.  "extra GiB" is the operator's peak allocation beyond its inputs and outputs (the chunk's logits).
Each figure is the median of ``REPS`` timed calls between CUDA events after warm-up.
"""

from __future__ import annotations

import statistics
import sys

import torch

from benchmarks.results_files import rerender_if_asked, write_results

SHAPES = {"llama-1b": (8192, 2048, 128256), "gemma2-2b": (8192, 2304, 256000), "h4096": (8192, 4096, 128256)}
CHUNKS = (512, 1024, 2048, 4096, 8192)
REPS = 10


def timed_ms(fn, reps: int = REPS) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls, each between its own pair of CUDA events."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gemm_parts(tokens: int, hidden: int, vocab: int, rows: int) -> dict[str, float]:
    """ms per chunk of each GEMM at chunk height ``rows``, and the whole head's GEMM time at that height."""
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
    dw = torch.zeros_like(w)
    parts = {
        "logits_ms": timed_ms(lambda: torch.mm(h, w.t(), out=logits)),
        "d_hidden_ms": timed_ms(lambda: torch.mm(logits, w, out=dh)),
        "d_weight_first_ms": timed_ms(lambda: torch.mm(logits.t(), h, out=dw)),
        "d_weight_accumulate_ms": timed_ms(lambda: dw.addmm_(logits.t(), h)),
    }
    chunks = -(-tokens // rows)
    parts["head_gemms_ms"] = chunks * (parts["logits_ms"] + parts["d_hidden_ms"]) + (
        parts["d_weight_first_ms"] + (chunks - 1) * parts["d_weight_accumulate_ms"]
    )
    parts["head_gemm_tflops"] = 3 * 2 * tokens * hidden * vocab / (parts["head_gemms_ms"] / 1e3) / 1e12
    return parts


def operator_cost(tokens: int, hidden: int, vocab: int, rows: int) -> dict[str, float]:
    """The adapt operator's forward + backward at chunk height ``rows``: ms and its transient peak."""
    from operators.kernels import fused_linear_cross_entropy

    h = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device="cuda")

    def once() -> None:
        h.grad = w.grad = None
        fused_linear_cross_entropy(h, w, y, chunk_size=rows).backward()

    ms = timed_ms(once)
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    once()
    torch.cuda.synchronize()
    outputs = h.numel() * 2 + w.numel() * 2  # the gradients it returns
    extra = (torch.cuda.max_memory_allocated() - base - outputs) / 2**30
    return {
        "operator_ms": ms,
        "operator_tflops": 3 * 2 * tokens * hidden * vocab / (ms / 1e3) / 1e12,
        "extra_gib": extra,
    }


def measure() -> dict:
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name, (tokens, hidden, vocab) in SHAPES.items():
        rows_out = {}
        for rows in CHUNKS:
            rows_out[str(rows)] = {
                **gemm_parts(tokens, hidden, vocab, rows),
                **operator_cost(tokens, hidden, vocab, rows),
            }
            print(name, rows, {k: round(v, 3) for k, v in rows_out[str(rows)].items()}, flush=True)
        results["shapes"][name] = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "by_chunk": rows_out}
    return results


def render(results: dict) -> str:
    lines = [
        "# Fused linear + cross-entropy by chunk height (one GPU)",
        "",
        f"{results['device']}, torch {results['torch']}, bf16; median of {REPS} calls. `head GEMMs` adds one chunk's "
        "three GEMMs over all chunks; `operator` is the whole forward + backward; TFLOP/s count the head's 3 GEMMs.",
        "",
        "| shape | chunk rows | logits ms | d_hidden ms | dW accumulate ms | head GEMMs ms | operator ms | "
        "operator TFLOP/s | extra GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, shape in results["shapes"].items():
        for rows, r in shape["by_chunk"].items():
            lines.append(
                f"| {name} T{shape['tokens']} H{shape['hidden']} V{shape['vocab']} | {rows} | {r['logits_ms']:.3f} | "
                f"{r['d_hidden_ms']:.3f} | {r['d_weight_accumulate_ms']:.3f} | {r['head_gemms_ms']:.2f} | "
                f"{r['operator_ms']:.2f} | {r['operator_tflops']:.0f} | {r['extra_gib']:.2f} |"
            )
    if results.get("note"):
        lines += ["", results["note"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not rerender_if_asked(argv, render):
        print(write_results(argv[0], measure(), render))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
