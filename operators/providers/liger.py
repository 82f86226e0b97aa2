"""Liger-Kernel as an optional external provider (CUDA only, when ``liger_kernel`` is installed).

Only the functional ops are used - never Liger's ``apply_liger_kernel_to_<model>`` table - so a
component recognised structurally gets Liger's kernel regardless of the model's class names."""

from __future__ import annotations

import importlib.util

from torch import nn

from operators.recognition.component import Component
from operators.registry import KernelOption, Target

# adapt's rounding orders (operators.kernels.norms.CAST_MODES) in Liger's casting-mode names
LIGER_CASTING_MODE = {"round_then_scale": "llama", "scale_then_round": "gemma"}


class LigerProvider:
    name = "liger"

    def available(self, target: Target) -> tuple[bool, str]:
        if importlib.util.find_spec("liger_kernel") is None:
            return False, "liger_kernel is not installed (pip install adapt[liger])"
        if target.device != "cuda":
            return False, "Liger-Kernel runs on CUDA only"
        return True, ""

    def options(self, component: Component, target: Target) -> list[KernelOption]:
        if not component.confirmed or not self.available(target)[0]:
            return []
        v = component.variant
        if component.kind == "rms_norm" and v.weight and v.cast in LIGER_CASTING_MODE:
            return [KernelOption(self.name, "LigerRMSNormFunction", "fused", rms_norm_forward, needs_codegen="triton")]
        if component.kind == "gated_mlp" and not v.packed and v.activation in ("silu", "gelu_tanh"):
            return [
                KernelOption(
                    self.name,
                    "LigerSiLUMulFunction" if v.activation == "silu" else "LigerGELUMulFunction",
                    "fused",
                    glu_forward,
                    needs_codegen="triton",
                )
            ]
        return []


def rms_norm_forward(module: nn.Module, component: Component):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    v = component.variant
    eps, offset, w_name = float(v.eps), float(v.offset), v.weight
    mode = LIGER_CASTING_MODE[v.cast]
    return lambda x: LigerRMSNormFunction.apply(x, getattr(module, w_name), eps, offset, mode, False)


def glu_forward(module: nn.Module, component: Component):
    v = component.variant
    if v.activation == "silu":
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction as fn
    else:
        from liger_kernel.ops.geglu import LigerGELUMulFunction as fn
    gate, up, down = (module.get_submodule(path) for path in (v.gate, v.up, v.down))
    return lambda x: down(fn.apply(gate(x), up(x)))
