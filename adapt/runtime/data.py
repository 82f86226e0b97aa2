"""Training data: a deterministic synthetic stream or a token file, served as global batches.

Every rank draws the same global batch for a step and keeps its data-parallel slice, so a run
is reproducible across layouts: the same step sees the same tokens whatever the parallelism.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from adapt.core.errors import BadInput


class SyntheticTokens:
    """Arithmetic progressions modulo the vocabulary: random start and stride per sequence, learnable."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def global_batch(self, step: int, batch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab_size, (batch, 1), generator=gen)
        stride = torch.randint(1, 8, (batch, 1), generator=gen)
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size


class TokenFile:
    """A flat token array: ``.npy`` (any integer dtype) or raw ``.bin`` of uint16, read through a memory map."""

    def __init__(self, path: str, vocab_size: int, seq_len: int):
        file = Path(path)
        if not file.is_file():
            raise BadInput(f"token file not found: {path}")
        tokens = _map_tokens(file)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise BadInput(f"{path}: expected a flat array of integer token ids")
        if len(tokens) < seq_len + 2:
            raise BadInput(f"{path}: {len(tokens)} tokens is shorter than one sequence of {seq_len + 1}")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise BadInput(f"{path}: token id {bad} is outside the model's vocabulary (0 to {vocab_size - 1})")
        self.tokens, self.seq_len = tokens, seq_len

    def global_batch(self, step: int, batch: int) -> torch.Tensor:
        windows = (len(self.tokens) - 1) // self.seq_len
        rows = [((step * batch + i) % windows) * self.seq_len for i in range(batch)]
        return torch.stack(
            [torch.from_numpy(np.asarray(self.tokens[r : r + self.seq_len + 1], dtype=np.int64)) for r in rows]
        )


def _map_tokens(file: Path) -> np.ndarray:
    """The file's tokens through a memory map.  An ``.npy`` of Python objects (a pickle) is refused, never loaded;
    a raw ``.bin`` must hold whole uint16 values."""
    try:
        if file.suffix == ".npy":
            return np.load(file, mmap_mode="r", allow_pickle=False)
        if file.stat().st_size % np.dtype(np.uint16).itemsize:
            raise BadInput(f"{file}: {file.stat().st_size} bytes is not a whole number of uint16 token ids")
        return np.memmap(file, dtype=np.uint16, mode="r")
    except BadInput:
        raise
    except (ValueError, OSError, EOFError) as err:
        if "pickle" in str(err) or "Python objects" in str(err):
            raise BadInput(f"{file}: holds pickled Python objects, which are never loaded; save integer ids") from None
        raise BadInput(f"{file}: not a readable token array ({err})") from None


def make_data(path: str | None, vocab_size: int, seq_len: int, seed: int = 0) -> SyntheticTokens | TokenFile:
    return TokenFile(path, vocab_size, seq_len) if path else SyntheticTokens(vocab_size, seq_len, seed)
