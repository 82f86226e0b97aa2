"""Per-block forward/backward timing for ``benchmarks/x8.py``: writes the planner's calibration JSON."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from adapt.model.intake import load_model, resolve_source
from adapt.runtime.model_parts import find_parts, head_geometry


def time_blocks(model, blocks, batch, repeats: int) -> list[tuple[float, float]]:
    """Median forward and backward seconds of each block inside a full forward+backward of ``model``.

    Forward: pre/post forward hooks.  Backward: from the moment the block's output gradient exists to
    the moment its input gradient exists (tensor hooks), which is that block's backward alone in a chain.
    """
    cuda = batch.device.type == "cuda"

    def stamp():
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(a, b) -> float:
        return a.elapsed_time(b) / 1e3 if cuda else b - a

    marks: dict = {}
    handles = []
    for i, block in enumerate(blocks):

        def pre(module, args, kwargs, i=i):
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.requires_grad:
                hidden.register_hook(lambda g: marks.__setitem__(("bwd_end", i), stamp()))
            marks["fwd_start", i] = stamp()

        def post(module, args, kwargs, output, i=i):
            marks["fwd_end", i] = stamp()
            hidden = output[0] if isinstance(output, tuple) else output
            hidden.register_hook(lambda g: marks.__setitem__(("bwd_start", i), stamp()))

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    samples: list[list[tuple[float, float]]] = []
    try:
        for repeat in range(repeats + 2):  # two warm-up passes
            marks.clear()
            logits = model(input_ids=batch, use_cache=False).logits
            logits.float().square().mean().backward()
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if repeat >= 2:
                samples.append([(seconds(marks["fwd_start", i], marks["fwd_end", i]),
                                 seconds(marks["bwd_start", i], marks["bwd_end", i])) for i in range(len(blocks))])  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    return [(statistics.median(s[i][0] for s in samples), statistics.median(s[i][1] for s in samples))
            for i in range(len(blocks))]  # fmt: skip


def calibrate(source: Path, mode: Any, out_path: Path, device: str, repeats: int = 5) -> Path:
    """Time every block of ``source`` on one device (micro-batch x seq, no model parallelism) and write
    the planner's calibration JSON."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if mode.precision == "bf16" else torch.float32
    with torch.device(device):
        model = load_model(resolve_source(str(source)), dtype=dtype, device=device).train()
    parts = find_parts(model, heads=head_geometry(model))
    blocks = list(model.get_submodule(parts.blocks_path).children())
    batch = torch.randint(0, parts.vocab_size, (mode.micro_batch, mode.seq_len), device=device)
    times = time_blocks(model, blocks, batch, repeats)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    out_path.write_text(json.dumps({
        "device": name, "dtype": mode.precision, "seq_len": mode.seq_len, "micro_batch": mode.micro_batch,
        "hidden_size": model.config.hidden_size, "tokens": mode.micro_batch * mode.seq_len,
        "blocks": [{"index": i, "forward_s": f, "backward_s": b} for i, (f, b) in enumerate(times)],
    }, indent=2))  # fmt: skip
    del model
    return out_path
