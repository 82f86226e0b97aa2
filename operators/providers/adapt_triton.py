"""adapt's own Triton kernels (``operators.kernels``): RMSNorm with offset and cast order, LayerNorm,
SwiGLU/GeGLU.  They run on CUDA, or on CPU only inside Triton's interpreter (``TRITON_INTERPRET=1``
set before import) - the provider reports itself unavailable anywhere else."""

from __future__ import annotations

import os

import torch
from torch import nn

from operators.recognition import Component
from operators.registry import KernelOption, Target

_GLU = {"silu": ("swiglu", None), "gelu": ("geglu", "none"), "gelu_tanh": ("geglu", "tanh")}


class AdaptTritonProvider:
    name = "adapt-triton"

    def available(self, target: Target) -> tuple[bool, str]:
        try:
            from operators import kernels
        except Exception as err:  # an import failure is a reason, not a crash
            return False, f"operators.kernels failed to import: {type(err).__name__}"
        if not getattr(kernels, "_HAVE_TRITON", False):
            return False, "triton is not installed"
        if target.device == "cuda":
            return True, ""
        if target.device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and kernels.available():
            return True, "Triton interpreter (CPU)"
        return False, f"no Triton backend for device {target.device!r} (CPU needs TRITON_INTERPRET=1)"

    def options(self, component: Component, target: Target) -> list[KernelOption]:
        if not component.confirmed or not self.available(target)[0]:
            return []
        v = component.variant
        if target.dtype not in ("float32", "bfloat16", "float16"):
            return []
        codegen = "triton" if target.device == "cuda" else None
        if component.kind == "rms_norm" and v.get("weight"):
            return [KernelOption(self.name, "rms_norm", "fused", rms_norm_forward, needs_codegen=codegen)]
        if component.kind == "layer_norm" and v.get("weight"):
            return [KernelOption(self.name, "layer_norm", "fused", layer_norm_forward, needs_codegen=codegen)]
        if component.kind == "gated_mlp" and v.get("activation") in _GLU and not v.get("packed"):
            return [KernelOption(self.name, _GLU[v["activation"]][0], "fused", glu_forward, needs_codegen=codegen)]
        return []


def rms_norm_forward(module: nn.Module, component: Component):
    from operators.kernels import rms_norm

    v = component.variant
    eps, offset, cast, w_name = float(v["eps"]), float(v["offset"]), v["cast"], v["weight"]
    return lambda x: rms_norm(x, getattr(module, w_name), eps, offset, cast)


def layer_norm_forward(module: nn.Module, component: Component):
    from operators.kernels import layer_norm

    v = component.variant
    eps, w_name, b_name = float(v["eps"]), v["weight"], v.get("bias")
    return lambda x: layer_norm(x, getattr(module, w_name), getattr(module, b_name) if b_name else None, eps)


def glu_forward(module: nn.Module, component: Component):
    from operators import kernels

    v = component.variant
    name, approximate = _GLU[v["activation"]]
    gate, up, down = (module.get_submodule(v[k]) for k in ("gate", "up", "down"))

    def forward(x: torch.Tensor) -> torch.Tensor:
        g, u = gate(x), up(x)
        h = kernels.swiglu(g, u) if name == "swiglu" else kernels.geglu(g, u, approximate)
        return down(h)

    return forward
