"""Decoder specs written from dimensions, shared by the planner tests."""

from __future__ import annotations

from parallel_planner.published import PublishedRun, run_spec


def decoder_spec(layers=8, hidden=1024, ffn=2816, heads=16, kv_heads=4, vocab=32000, seq=2048, gated=True):
    """A Llama-style (gated) or GPT-style (plain) decoder spec with the given dimensions."""
    run = PublishedRun(
        source="llama3" if gated else "megatron2021",
        model="test",
        params_b=0,
        layers=layers,
        hidden=hidden,
        ffn=ffn,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        seq=seq,
        gpu="h100",
        gpus=8,
        tp=1,
        pp=1,
        dp=8,
        cp=1,
        ep=1,
        zero=1,
        global_batch_seqs=8,
        recompute="none",
        reported_tflops_per_gpu=1,
        reported_pct_peak=1,
    )
    return run_spec(run)
