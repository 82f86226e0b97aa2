"""Build the bundled example checkpoint(s) under ``examples/``; run once, the output is committed.

    python examples/make_examples.py            # writes examples/tiny-llama/

``tiny-llama`` is a real Llama architecture (GQA, RMSNorm, SwiGLU, RoPE) at toy width: 2 blocks,
hidden 64, vocab 256, random weights (seed 0), saved by transformers' own ``save_pretrained``
as config.json + model.safetensors (about 430 KB).  ``adapt run examples/tiny-llama`` completes
every stage on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from adapt.model.zoo import build_tiny_checkpoint  # noqa: E402

EXAMPLES = {"tiny-llama": "llama"}
HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write the examples into (default: examples/)")
    args = parser.parse_args()
    for name, family in EXAMPLES.items():
        path = build_tiny_checkpoint(family, args.out / name, seed=0)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        print(f"{path}: {family}, {size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
