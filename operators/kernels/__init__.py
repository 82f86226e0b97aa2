"""adapt's Triton kernel library: fused, training-grade kernels with forward and backward passes.

Each function takes ordinary tensors (bf16, fp16 or fp32, any leading dims, non-power-of-two widths,
strided inputs) and returns tensors that autograd differentiates through a ``torch.autograd.Function``
backed by Triton kernels. On a machine without CUDA the kernels run in Triton's interpreter when
``TRITON_INTERPRET=1`` is set before this package is imported.
"""

from __future__ import annotations

import torch

try:
    import triton  # noqa: F401
except ImportError:  # e.g. macOS wheels of torch ship without Triton
    _HAVE_TRITON = False
else:
    _HAVE_TRITON = True
    from ._utils import interpreting
    from .cross_entropy import fused_linear_cross_entropy
    from .glu import geglu, swiglu
    from .grouped_gemm import GemmConfig, grouped_gemm
    from .moe import PermutationState, moe_permute, moe_route, moe_unpermute
    from .norms import RowConfig, add_rms_norm, layer_norm, rms_norm
    from .rope import apply_rotary


def available() -> bool:
    """True when Triton is importable and can run here (a CUDA device, or the interpreter)."""
    return _HAVE_TRITON and (torch.cuda.is_available() or interpreting())


__all__ = [
    "GemmConfig",
    "PermutationState",
    "RowConfig",
    "add_rms_norm",
    "apply_rotary",
    "available",
    "fused_linear_cross_entropy",
    "geglu",
    "grouped_gemm",
    "layer_norm",
    "moe_permute",
    "moe_route",
    "moe_unpermute",
    "rms_norm",
    "swiglu",
]
