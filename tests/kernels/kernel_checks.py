"""Float64-reference comparison helpers shared by the kernel tests."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ||out - ref|| / ||ref|| bounds against float64 references; one rounding of the output dominates.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    assert torch.isfinite(out64).all(), "non-finite values (unwritten or poisoned output?)"
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0, what: str = "") -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    assert err <= TOLERANCE[dtype] * scale, f"{what}: relative error {err:.3g} > {TOLERANCE[dtype] * scale:.3g}"


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round a float64 tensor to ``dtype`` and back, with a straight-through gradient."""
    return x + (x.to(dtype).to(x.dtype) - x).detach()


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def ref_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64).clone().requires_grad_(True)
