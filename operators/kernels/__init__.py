"""adapt's Triton kernel library: fused, training-grade kernels with forward and backward passes.

Each function takes ordinary tensors (bf16, fp16 or fp32, any leading dims, non-power-of-two widths,
strided inputs) and calls one ``torch.ops.adapt`` operator (``ops``) whose forward and backward are
Triton kernels, so autograd, Dynamo and ``torch.export`` treat every kernel as a single node. The
modules named after the kernels hold the Triton code and its launch; ``functional`` holds these
functions. On a machine without CUDA the kernels run in Triton's interpreter when
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
    from .functional import (
        add_rms_norm,
        apply_rotary,
        fused_linear_cross_entropy,
        geglu,
        glu_linear,
        grouped_gemm,
        layer_norm,
        moe_permute,
        moe_route,
        moe_unpermute,
        rms_norm,
        swiglu,
    )
    from .gemm import GemmConfig
    from .moe import PermutationState
    from .norms import RowConfig


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
    "glu_linear",
    "grouped_gemm",
    "layer_norm",
    "moe_permute",
    "moe_route",
    "moe_unpermute",
    "rms_norm",
    "swiglu",
]
