"""How the GPU benchmarks here time one call: warm-up calls, then back-to-back calls between two CUDA events."""

from __future__ import annotations

from collections.abc import Callable

import torch


def mean_seconds(once: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Seconds per call of ``once``, the mean of ``reps`` calls issued back to back after ``warmup`` calls."""
    for _ in range(warmup):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        once()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps
