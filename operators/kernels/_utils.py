"""Shared helpers for the Triton kernels: row views, launch sizing, dtype checks."""

from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1).  Plain Python: ``triton.next_power_of_2`` is a
    ``constexpr_function`` in recent Triton, and its call wrapper costs ~10 us of host time per call,
    which the launch paths of small kernels (RoPE, routing) paid several times per step."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division; symbolic sizes stay symbolic (launch code traced with ``ADAPT_KERNEL_OPS=inductor``)."""
    return -(-a // b)


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as ``[rows, width]`` without copying when the last dim is unit-stride.

    Non-contiguous inputs whose rows are evenly strided (slices, chunks of a fused projection) stay
    views; anything else (e.g. a transposed last dim) is copied once, because every kernel here
    streams whole rows and a strided inner dimension would defeat vectorised loads.
    """
    if x.dim() == 0:
        raise ValueError("expected at least one dimension")
    width = x.shape[-1]
    if x.is_contiguous():
        return x.view(-1, width)
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        rows = x.view(-1, width)
    except RuntimeError:
        rows = x.reshape(-1, width)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < width):
        rows = rows.contiguous()
    return rows


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs(device: torch.device, per_sm: int) -> int:
    """Persistent-grid size: ``per_sm`` resident programs on every SM (a small fixed grid on CPU)."""
    if device.type == "cuda":
        return sm_count(device.index if device.index is not None else torch.cuda.current_device()) * per_sm
    return 4


def row_block(width: int, target_elems: int, max_rows: int = 16) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_M) for row kernels: a whole row per tile, several short rows stacked so a tile
    carries ``target_elems`` elements and every load stays wide."""
    block_n = next_pow2(width)
    if block_n > 65536:
        raise ValueError(f"row width {width} exceeds the 65536 elements a single tile holds")
    block_m = max(1, min(max_rows, target_elems // block_n))
    return block_n, block_m


def warps_for(tile_elems: int) -> int:
    """Enough warps that each thread holds ~16 elements of a tile (8 to 32 values per row tile)."""
    return int(min(32, max(4, tile_elems // (32 * 16))))
