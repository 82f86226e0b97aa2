"""adapt's own Triton kernels (``operators.kernels``): RMSNorm with offset and cast order, LayerNorm,
SwiGLU/GeGLU, and routed MoE blocks (route, permute, grouped GEMM, GLU, weighted unpermute).  They run
on CUDA, or on CPU only inside Triton's interpreter (``TRITON_INTERPRET=1`` set before import) - the
provider reports itself unavailable anywhere else.  Rotary embedding (``triton_rope``) and the fused
linear cross-entropy of a causal LM's loss (``triton_head``) patch through the model's own functions;
a residual add in a block's own code fuses with the norm it feeds (``triton_residual``)."""

from __future__ import annotations

import functools
import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from operators.providers import triton_head, triton_moe, triton_residual, triton_rope
from operators.recognition.component import Component
from operators.registry import KernelOption, Target

# the gated unit's activation -> the kernel's name (the unit fused with the down projection after it)
_GLU = {"silu": "swiglu_linear", "gelu": "geglu_linear", "gelu_tanh": "geglu_linear"}


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
        failure = _self_test_remembered(device)
        return (False, f"kernel self-test failed on {device}: {failure}") if failure else (True, "")

    def options(self, component: Component, target: Target) -> list[KernelOption]:
        if not component.confirmed or not self.available(target)[0]:
            return []
        v = component.variant
        if target.dtype not in ("float32", "bfloat16", "float16"):
            return []
        codegen = "triton"  # Triton kernels only exist where the profile can run Triton (interpreter included)
        if component.kind == "rms_norm" and v.weight:
            return [KernelOption(self.name, "rms_norm", "fused", rms_norm_forward, needs_codegen=codegen)]
        if component.kind == "layer_norm" and v.weight:
            return [KernelOption(self.name, "layer_norm", "fused", layer_norm_forward, needs_codegen=codegen)]
        if component.kind == "gated_mlp" and v.activation in _GLU and not v.packed:
            return [
                KernelOption(
                    self.name,
                    _GLU[v.activation],
                    "fused",
                    glu_forward,
                    needs_codegen=codegen,
                    keeps_less="the unit's output is remade in the backward, not kept",
                )
            ]
        if component.kind == "rotary_application" and (v.table, v.layout) == ("cos_sin", "bhsd"):
            return [
                KernelOption(
                    self.name,
                    f"apply_rotary ({v.style})",
                    "fused",
                    triton_rope.rotary_forward,
                    needs_codegen=codegen,
                    note=f"stands in for {v.function} while this module runs",
                )
            ]
        if component.kind == "lm_head_cross_entropy":
            return [
                KernelOption(
                    self.name,
                    "fused_linear_cross_entropy",
                    "fused",
                    triton_head.head_forward,
                    needs_codegen=codegen,
                    note="forward with labels: loss from the decoder output, logits not materialised (None)",
                )
            ]
        if component.kind == "residual_add_norm" and v.norm == "rms_norm" and v.weight and v.add_after is not None:
            return [
                KernelOption(
                    self.name,
                    "add_rms_norm",
                    "fused",
                    triton_residual.install_pair,
                    needs_codegen=codegen,
                    note=f"the add after {v.add_after} returns, and this norm, in one pass",
                )
            ]
        if component.kind == "moe" and triton_moe.unsupported_reason(v, target.training) is None:
            return [KernelOption(self.name, "moe_grouped_gemm", "fused", triton_moe.moe_forward, needs_codegen=codegen)]
        return []


def rms_norm_forward(module: nn.Module, component: Component):
    from operators.kernels import rms_norm

    v = component.variant
    eps, offset, cast, w_name = float(v.eps), float(v.offset), v.cast, v.weight
    return lambda x: rms_norm(x, getattr(module, w_name), eps, offset, cast)


def layer_norm_forward(module: nn.Module, component: Component):
    from operators.kernels import layer_norm

    v = component.variant
    eps, w_name, b_name = float(v.eps), v.weight, v.bias
    return lambda x: layer_norm(x, getattr(module, w_name), getattr(module, b_name) if b_name else None, eps)


def glu_forward(module: nn.Module, component: Component):
    """The gated unit as one kernel, fused with the down projection (``kernels.glu_linear``: the unit's output,
    one ``[tokens, ffn]`` tensor per layer, is not kept for the backward) where that projection is a plain
    ``nn.Linear``.  A projection that is wrapped, hooked (adapters, quantisation) or sharded (a DTensor weight
    under tensor parallelism) runs as its own module after the unit's kernel, which keeps the output."""
    from operators import kernels

    v = component.variant
    activation = v.activation
    gate, up, down = (module.get_submodule(path) for path in (v.gate, v.up, v.down))

    def forward(x: torch.Tensor) -> torch.Tensor:
        g, u = gate(x), up(x)
        if _plain_linear(down) and down.weight.dtype == g.dtype:  # (under autocast F.linear would cast)
            return kernels.glu_linear(g, u, down.weight, down.bias, activation)
        return down(torch.ops.adapt.glu(g, u, activation))

    return forward


def _plain_linear(module: nn.Module) -> bool:
    """Whether calling ``module`` is exactly ``F.linear`` on its own local tensors (nothing else runs)."""
    return (
        type(module) is nn.Linear
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and not isinstance(module.weight, DTensor)
    )


@functools.cache
def _self_test_remembered(device: str) -> str | None:
    """``_self_test``, with a pass kept on disk per device, library versions and kernel sources (a failure is
    never kept: it is tried again next run)."""
    from pathlib import Path

    from operators.timing_cache import DiskCache, make_key, source_digest

    here = Path(__file__).parent
    cache = DiskCache("kernel_self_test")
    key = make_key(device, "self-test", source_digest(here, here.parent / "kernels"))
    if cache.get(key) == "passed":
        return None
    failure = _self_test(device)
    if failure is None:
        cache.put(key, "passed")
    return failure


@functools.cache
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
    r = torch.randn(3, 40, generator=gen)
    cases = {
        "rms_norm": (
            lambda x, w: kernels.rms_norm(x, w, 1e-6, 1.0, "scale_then_round"),
            lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w),
            (x, w),
        ),
        "layer_norm": (
            lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5),
            lambda x, w, b: F.layer_norm(x, (40,), w, b, 1e-5),
            (x, w, b),
        ),
        "add_rms_norm": (
            lambda x, r, w: torch.cat(kernels.add_rms_norm(x, r, w, 1e-6, 0.0, "round_then_scale"), -1),
            lambda x, r, w: torch.cat(
                [x + r, (x + r) * torch.rsqrt((x + r).pow(2).mean(-1, keepdim=True) + 1e-6) * w], -1
            ),
            (x, r, w),
        ),
        "swiglu": (kernels.swiglu, lambda g, u: F.silu(g) * u, (g, u)),
        "geglu": (lambda g, u: kernels.geglu(g, u, "tanh"), lambda g, u: F.gelu(g, approximate="tanh") * u, (g, u)),
        **triton_rope.self_test_cases(gen),
        **triton_head.self_test_cases(gen),
        "moe": _moe_case(gen),
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


def _moe_case(gen: torch.Generator):
    """Sigmoid-scored, grouped, biased routing into GeGLU experts: every MoE kernel, forward and backward."""
    import torch.nn.functional as F

    spec = triton_moe.RoutedExperts(
        num_experts=4,
        top_k=2,
        scoring="sigmoid",
        n_group=2,
        topk_group=1,
        scale=1.5,
        activation="gelu_tanh",
        gate_first=False,
    )
    bias = torch.tensor([0.0, 0.3, -0.2, 0.1])
    inputs = tuple(torch.randn(s, generator=gen) for s in ((5, 24), (4, 24), (4, 24, 20), (4, 10, 24)))

    def kernel(x, w_router, w_gate_up, w_down):
        return triton_moe.routed_experts(x, x @ w_router.t(), w_gate_up, w_down, spec, bias.to(x.device))

    def reference(x, w_router, w_gate_up, w_down):
        scores = torch.sigmoid(x @ w_router.t())
        choice = (scores + bias.double()).view(-1, 2, 2)
        best_group = choice.topk(2, dim=-1).values.sum(-1).argmax(-1)
        keep = F.one_hot(best_group, 2).bool().unsqueeze(-1).expand_as(choice).reshape(-1, 4)
        ids = choice.reshape(-1, 4).masked_fill(~keep, -torch.inf).topk(2, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = 1.5 * weights / weights.sum(-1, keepdim=True)
        up, gate = torch.einsum("th,ehn->ten", x, w_gate_up).chunk(2, dim=-1)
        experts = torch.einsum("ten,enh->teh", F.gelu(gate, approximate="tanh") * up, w_down)
        return (weights.unsqueeze(-1) * experts.gather(1, ids.unsqueeze(-1).expand(-1, -1, x.shape[1]))).sum(1)

    return kernel, reference, inputs
