"""adapt's own Triton kernels (``operators.kernels``): RMSNorm with offset and cast order, LayerNorm,
SwiGLU/GeGLU.  They run on CUDA, or on CPU only inside Triton's interpreter (``TRITON_INTERPRET=1``
set before import) - the provider reports itself unavailable anywhere else."""

from __future__ import annotations

import functools
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
        if target.device == "cuda" and torch.cuda.is_available():
            device = "cuda"
        elif target.device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and kernels.available():
            device = "cpu"
        else:
            return False, f"no Triton backend for device {target.device!r} (CPU needs TRITON_INTERPRET=1)"
        failure = _self_test(device)
        return (False, f"kernel self-test failed on {device}: {failure}") if failure else (True, "")

    def options(self, component: Component, target: Target) -> list[KernelOption]:
        if not component.confirmed or not self.available(target)[0]:
            return []
        v = component.variant
        if target.dtype not in ("float32", "bfloat16", "float16"):
            return []
        codegen = "triton"  # Triton kernels only exist where the profile can run Triton (interpreter included)
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


@functools.lru_cache(maxsize=None)
def _self_test(device: str) -> str | None:
    """Run every kernel this provider offers once, forward and backward, against PyTorch in float64.

    A Triton build (or interpreter) that cannot run them makes the provider unavailable instead of
    failing later inside a patched model.  Returns None on success, else the reason.
    """
    import torch.nn.functional as F

    from operators import kernels

    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen) for s in ((3, 40), (40,), (40,)))
    g, u = torch.randn(3, 24, generator=gen), torch.randn(3, 24, generator=gen)
    cases = {
        "rms_norm": (lambda x, w: kernels.rms_norm(x, w, 1e-6, 1.0, "gemma"), lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w), (x, w)),
        "layer_norm": (lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5), lambda x, w, b: F.layer_norm(x, (40,), w, b, 1e-5), (x, w, b)),
        "swiglu": (kernels.swiglu, lambda g, u: F.silu(g) * u, (g, u)),
        "geglu": (lambda g, u: kernels.geglu(g, u, "tanh"), lambda g, u: F.gelu(g, approximate="tanh") * u, (g, u)),
    }
    for name, (kernel, reference, inputs) in cases.items():
        try:
            got_in = [t.detach().clone().to(device).requires_grad_() for t in inputs]
            out = kernel(*got_in)
            out.sum().backward()
            ref_in = [t.detach().double().requires_grad_() for t in inputs]
            ref = reference(*ref_in)
            ref.sum().backward()
            ok = torch.allclose(out.double().cpu(), ref, atol=1e-4, rtol=1e-4) and all(
                torch.allclose(a.grad.double().cpu(), r.grad, atol=1e-4, rtol=1e-4) for a, r in zip(got_in, ref_in)
            )
        except Exception as err:  # any failure means the kernel cannot be offered here
            return f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        if not ok:
            return f"{name}: result differs from PyTorch"
    return None
