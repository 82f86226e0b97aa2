"""adapt's own Triton kernels (``operators.kernels``): RMSNorm with offset and cast order, LayerNorm,
SwiGLU/GeGLU, and routed MoE blocks (route, permute, grouped GEMM, GLU, weighted unpermute).  They run
on CUDA, or on CPU only inside Triton's interpreter (``TRITON_INTERPRET=1`` set before import) - the
provider reports itself unavailable anywhere else.  Rotary embedding (``triton_rope``) and the fused
linear cross-entropy of a causal LM's loss (``triton_head``) patch through the model's own functions;
a residual add in a block's own code fuses with the norm it feeds (``triton_residual``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from adapt.model.activations import ACTIVATIONS
from operators.providers import triton_head, triton_moe, triton_residual, triton_rope
from operators.recognition.component import Component
from operators.registry import KernelOption, Target

log = logging.getLogger(__name__)

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
        failure = _case_failure(device, CANARY_CASE)
        if failure:
            return False, f"kernel self-test failed on {device}: {failure}"
        failed = sorted(why for (on, _), why in _verdicts.items() if on == device and why)
        return True, (f"kernels off after their self-test failed on {device}: {'; '.join(failed)}" if failed else "")

    def options(self, component: Component, target: Target) -> list[KernelOption]:
        """The kernels for ``component``, each verified by its family's self-test when the plan picks it (a family
        that already failed in this process is not offered)."""
        if not component.confirmed or not self.available(target)[0]:
            return []
        if target.dtype not in ("float32", "bfloat16", "float16"):
            return []
        options = self._options(component, target)
        cases = _cases_of(component) if options else ()
        if any(_verdicts.get((target.device, name)) for name in cases):
            return []
        verify = functools.partial(_first_failure, target.device, cases)
        return [dataclasses.replace(o, verify=verify) for o in options]

    def _options(self, component: Component, target: Target) -> list[KernelOption]:
        v = component.variant
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
        if component.kind == "routed_experts" and triton_moe.experts_unsupported_reason(v) is None:
            return [
                KernelOption(
                    self.name,
                    "moe_experts_grouped_gemm",
                    "fused",
                    triton_moe.experts_forward,
                    needs_codegen=codegen,
                    note="the block's own routing chooses; permute, grouped GEMMs and the weighted sum run here",
                )
            ]
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


# The case every use of the provider runs first: a Triton build (or interpreter) that cannot run it makes the
# provider unavailable.  The other cases run when a component first asks for their kernels (``_cases_of``), so a
# cold start compiles only the kernels the model can use.
CANARY_CASE = "rms_norm"


CASE_OF_KIND = {
    "rms_norm": "rms_norm",
    "layer_norm": "layer_norm",
    "lm_head_cross_entropy": "linear_cross_entropy",
    "residual_add_norm": "add_rms_norm",
    "moe": "moe",
    "routed_experts": "moe",  # the same permute, grouped GEMM, GLU and unpermute kernels
}


def _cases_of(component: Component) -> tuple[str, ...]:
    """The self-test cases behind the kernels offered for ``component``."""
    kind, v = component.kind, component.variant
    if kind == "gated_mlp":
        return (f"glu_linear_{v.activation}",)
    if kind == "rotary_application":
        return (f"rotary_{v.style}",)
    return (CASE_OF_KIND[kind],)


# This process's verdicts: (device, case) -> None (passed) or why it failed.  A failure is also kept here, so that
# a broken family costs one run per process; on disk only passes are kept, so it is tried again next run.
_verdicts: dict[tuple[str, str], str | None] = {}


def _case_failure(device: str, name: str) -> str | None:
    """``_self_test`` of one case, run once per process, with a pass kept on disk per device, library versions and
    kernel sources."""
    key = (device, name)
    if key not in _verdicts:
        _verdicts[key] = _remembered_or_run(device, name)
    return _verdicts[key]


def _first_failure(device: str, cases: tuple[str, ...]) -> str | None:
    """Why the first of ``cases`` to fail its self-test on ``device`` failed (each case runs once per process)."""
    return next(filter(None, (_case_failure(device, name) for name in cases)), None)


def _remembered_or_run(device: str, name: str) -> str | None:
    from pathlib import Path

    from operators.timing_cache import DiskCache, make_key, source_digest

    here = Path(__file__).parent
    cache = DiskCache("kernel_self_test")
    key = make_key(device, "self-test", name, source_digest(here, here.parent / "kernels"))
    if cache.get(key) == "passed":
        return None
    began = time.perf_counter()
    failure = _self_test(device, (name,))
    log.debug("self-test %s on %s: %.2f s (%s)", name, device, time.perf_counter() - began, failure or "passed")
    if failure is None:
        cache.put(key, "passed")
    return failure


def self_test_everything(device: str) -> dict[str, str | None]:
    """Every case's verdict on ``device`` (None: passed), each run now unless this process or the disk has it."""
    return {name: _case_failure(device, name) for name in _self_test_cases()}


def _self_test(device: str, names: tuple[str, ...] | None = None) -> str | None:
    """Run the named kernels (all this provider offers when None) once, forward and backward, against PyTorch
    in float64.

    A kernel that cannot run here, or runs wrong, is then not offered instead of failing later inside a patched
    model.  Returns None on success, else the reason.
    """
    cases = _self_test_cases()
    unknown = set(names or ()) - set(cases)
    if unknown:
        raise KeyError(f"no self-test case {sorted(unknown)}")
    for name in names or tuple(cases):
        kernel, reference, inputs = cases[name]
        failure = _run_case(device, kernel, reference, inputs)
        if failure:
            return f"{name}: {failure}"
    return None


def _run_case(device: str, kernel, reference, inputs) -> str | None:
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
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    return None if ok else "result differs from PyTorch"


@functools.cache
def _self_test_cases() -> dict[str, tuple]:
    """(kernel, float64 reference, inputs) per case, on CPU tensors of a fixed seed (each run clones them).  Built
    once: every kernel is looked up when its case runs, not when it is built."""
    import torch.nn.functional as F

    from operators import kernels

    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen) for s in ((3, 40), (40,), (40,)))
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
        **{f"glu_linear_{activation}": _glu_case(activation, gen) for activation in _GLU},
        **triton_rope.self_test_cases(gen),
        **triton_head.self_test_cases(gen),
        "moe": _moe_case(gen),
    }
    return cases


def _glu_case(activation: str, gen: torch.Generator) -> tuple:
    """The gated unit fused with its down projection (biased), and the unit alone (the path taken when that
    projection is not a plain linear layer)."""
    import torch.nn.functional as F

    from operators import kernels

    def kernel(g, u, w, b):
        fused = kernels.glu_linear(g, u, w, b, activation)
        return torch.cat([fused.flatten(), torch.ops.adapt.glu(g, u, activation).flatten()])

    def reference(g, u, w, b):
        unit = ACTIVATIONS[activation](g) * u
        return torch.cat([F.linear(unit, w, b).flatten(), unit.flatten()])

    shapes = ((3, 24), (3, 24), (16, 24), (16,))
    return kernel, reference, tuple(torch.randn(s, generator=gen) for s in shapes)


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
