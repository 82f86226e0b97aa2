"""Where one adapted training step makes the host wait for the device, with the Python stack of each wait.

    PYTHONPATH=$PWD python benchmarks/sync_points.py --out DIR [--model llama-1b]     # needs CUDA

A synchronisation drains the launch queue: afterwards the device idles for as long as the host takes to issue
its next kernel.  ``torch.cuda.set_sync_debug_mode("warn")`` flags every synchronising call; this script runs
the operators stage on the reference shape's checkpoint, applies its plan with ``operators.adapt_model``, takes
three warm-up steps (compilation), then one step with the flag on, and records each warning's stack.  Writes
``sync-points-h200-<model>.json``.  The mode does not flag every kind of wait (torch calls it a prototype); an
empty list means no device-to-host read or explicit synchronise in the step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import traceback
import warnings
from pathlib import Path

from benchmarks.shapes import SHAPES, build_checkpoint, load_checkpoint


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()

    import torch

    from operators import adapt_model, run_ops
    from operators.optim import TritonAdamW

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_checkpoint(args.model, Path(tmp) / "checkpoint")
        plan = run_ops(str(checkpoint), onnx=False, check_patch=False).plan
        model = load_checkpoint(checkpoint).cuda().train()
    adapt_model(model, plan)
    optimizer = TritonAdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")

    def step() -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    found: list[dict[str, object]] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith("Synchronization debug mode is a prototype"):
            return  # the mode's own notice, given when it is switched on
        stack = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()]
        found.append({"message": str(message)[:200], "stack": stack[-14:-1]})

    previous = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            loss = step()
            torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = previous
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "device": torch.cuda.get_device_name(), "loss": float(loss), "sync_points": found}
    (out / f"sync-points-h200-{args.model}.json").write_text(json.dumps(result, indent=1))
    for point in found:
        print(point["message"], *point["stack"][-8:], sep="\n    ")
    print(f"{len(found)} synchronising calls in one step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
