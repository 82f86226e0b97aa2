"""Run by ``test_kernel_ops_mode`` in a process with ``ADAPT_KERNEL_OPS=inductor`` and no ``TRITON_INTERPRET``:
traces each converted operator with FakeTensors and prints, as JSON, what the traces hold.

No GPU is needed to trace, with three limits of a CPU-only torch build, worked around here:
* nothing can ask the device for its SM count (``_utils.sm_count`` is given the H200's);
* slicing a fake CUDA tensor under functionalization and autograd on fake CUDA tensors ask for a CUDA device
  guard, which the build lacks: the cross-entropy operators (their chunk loop slices) and the
  ``torch.compile`` of a block's forward and backward are traced on the ``meta`` device, through the same
  launch code;
* Triton cannot say which arguments a kernel writes (no driver to build its TTIR for), so every tensor argument
  is taken as written (a warning, silenced here); on a GPU that analysis runs.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import aot_function
from torch._library.triton import get_triton_kernels_for_op
from torch._subclasses.fake_tensor import FakeTensorMode

from operators.kernels import _registration, _utils, ops

logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
_utils.sm_count = lambda index: 132  # no device to ask

A = torch.ops.adapt
WRAPPERS = ("triton_kernel_wrapper_functional", "triton_kernel_wrapper_mutation")
ROPE = (False, 16)
NORM = (0.0, "round_then_scale")


class _Captured(Exception):
    """Raised by the compiler hook with the traced graph: nothing can run on a fake CUDA tensor."""


def _capture(gm: torch.fx.GraphModule, example_inputs) -> None:
    raise _Captured(gm)


def kernel_nodes(gm: torch.fx.GraphModule) -> int:
    return sum(1 for node in gm.graph.nodes if str(node.target) in WRAPPERS)


def traced(fn, *args) -> torch.fx.GraphModule:
    """The functional forward graph AOTAutograd traces for ``fn(*args)``."""
    try:
        aot_function(fn, fw_compiler=_capture)(*args)
    except _Captured as captured:
        return captured.args[0]
    raise AssertionError("the compiler hook was not called")


def cases(device: str):
    """(operator, function of tensors, tensors): the converted operators, on ``cuda`` all but the cross-entropy
    ones, which ``meta`` takes (see the module's docstring)."""
    bf = torch.bfloat16

    def r(*shape, dtype=bf):
        return torch.randn(*shape, device=device, dtype=dtype)

    x, w, rstd = r(4, 64), r(64), r(4, dtype=torch.float32)
    q, k, cos = r(2, 4, 8, 16), r(2, 2, 8, 16), r(1, 8, 16)
    g, wd = r(4, 128), r(64, 128)
    h, head, labels = r(16, 64), r(100, 64), torch.randint(0, 100, (16,), device=device)
    if device == "meta":
        ce = (-100, 0.0, 0.0, None)
        yield (
            "fused_linear_cross_entropy",
            lambda h, w, y: A.fused_linear_cross_entropy(h, w, y, None, *ce, "mean", 8, True, True, False),
            (h, head, labels),
        )
        yield (
            "fused_linear_cross_entropy_backward",
            lambda h, w, y, d: A.fused_linear_cross_entropy_backward(d, h, w, y, None, *ce, 8, True, True, False),
            (h, head, labels, r(16, dtype=torch.float32)),
        )
        return
    yield "rms_norm", lambda x, w: A.rms_norm(x, w, 1e-6, *NORM, [], True), (x, w)
    yield "add_rms_norm", lambda x, w: A.add_rms_norm(x, x, w, 1e-6, *NORM, [], True), (x, w)
    yield "rms_norm_backward", lambda x, w, s: A.rms_norm_backward(x, x, x, w, s, *NORM, True, []), (x, w, rstd)
    yield "layer_norm", lambda x, w: A.layer_norm(x, w, w, 1e-5, [], True), (x, w)
    yield "layer_norm_backward", lambda x, w, s: A.layer_norm_backward(x, x, w, w, s, s, True, True, []), (x, w, rstd)
    yield "glu", lambda g: A.glu(g, g, "silu"), (g,)
    yield "glu_backward", lambda g: A.glu_backward(g, g, g, "silu"), (g,)
    yield "glu_linear", lambda g, wd: A.glu_linear(g, g, wd, None, "silu"), (g, wd)
    yield "glu_linear_backward", lambda g, wd, x: A.glu_linear_backward(x, g, g, wd, "silu", True, False), (g, wd, x)
    yield "apply_rotary", lambda q, k, c: A.apply_rotary(q, k, c, c, *ROPE), (q, k, cos)
    strides = list(q.stride()), list(k.stride())
    yield "apply_rotary_backward", lambda q, k, c: A.apply_rotary_backward(q, k, c, c, *ROPE, *strides), (q, k, cos)


def compiled_block() -> dict[str, dict[str, int | bool]]:
    """``torch.compile`` of a block's kernels (residual add + RMSNorm, rotary, gated unit with its projection) and
    their gradients, the sequence length marked dynamic: per graph, its kernel nodes and whether its inputs keep
    a symbolic size (``mark_dynamic`` raises if the launch code specialised it)."""
    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return gm

        return compiler

    def block(x, res, w, proj, down, cos):
        total, y, _ = A.add_rms_norm(x, res, w, 1e-6, *NORM, [], True)
        q = y.view(2, -1, 4, 16).transpose(1, 2)
        q, k = A.apply_rotary(q, q, cos, cos, *ROPE)
        gate_up = (q + k).transpose(1, 2).reshape(2, -1, 64) @ proj
        out = A.glu_linear(gate_up[..., :128], gate_up[..., 128:], down, None, "silu")
        return (total + out).float().sum()

    def leaf(*shape):
        return torch.randn(*shape, device="meta", requires_grad=True)

    x, res, cos = leaf(2, 64, 64), leaf(2, 64, 64), torch.randn(1, 64, 16, device="meta")
    for t in (x, res, cos):
        torch._dynamo.mark_dynamic(t, 1)
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    torch.compile(block, backend=backend, fullgraph=True)(
        x, res, leaf(64), leaf(64, 256), leaf(64, 128), cos
    ).backward()
    return {
        name: {
            "kernels": kernel_nodes(gm),
            "symbolic": any(
                isinstance(node.meta.get("val"), torch.SymInt) for node in gm.graph.nodes if node.op == "placeholder"
            ),
        }
        for name, gm in graphs.items()
    }


def main() -> None:
    calls_before = dict(ops.CALLS)
    nodes: dict[str, int] = {}
    with FakeTensorMode():
        for device in ("cuda", "meta"):
            for name, fn, args in cases(device):
                nodes[name] = kernel_nodes(traced(fn, *args))
    triton_ops = sorted(name for name in torch._library.triton.triton_ops_to_kernels if get_triton_kernels_for_op(name))
    result = {
        "mode": _registration.MODE,
        "interpret": os.environ.get("TRITON_INTERPRET"),
        "triton_ops": triton_ops,
        "schemas": {name: str(getattr(A, name.split("::")[1]).default._schema) for name in triton_ops},
        "kernel_nodes": nodes,
        "compiled": compiled_block(),
        "calls_advanced": {name: n for name, n in ops.CALLS.items() if n != calls_before.get(name, 0)},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
