"""How adapt's kernels become ``torch.library`` operators: one mode for the whole process, read once at import.

``ADAPT_KERNEL_OPS`` picks it:

* ``opaque`` (the default): ``custom_op``.  Inductor sees one opaque call per kernel and its generated code goes
  through the dispatcher, our Python launch code and Triton's launcher on every call.
* ``inductor``: ``triton_op``, with every launch written ``launch(kernel)[grid](...)`` (``wrap_triton``).
  AOTAutograd traces the launch code into the graph, so Inductor compiles the kernels with its own and launches
  them from its generated code.  The launch code must then be traceable with FakeTensors: no ``.item()``, no
  Python branch on tensor values, and no cache or ``int()`` of a size that a graph compiled at a dynamic
  sequence length leaves symbolic (the row count): that fails (a SymInt is unhashable) or specialises the graph.

Under Triton's CPU interpreter (``TRITON_INTERPRET=1``) the mode is always ``opaque``: ``triton.jit`` returns an
interpreted function there, which ``wrap_triton`` refuses, and Inductor cannot compile a kernel for the CPU
anyway.  Operator names, schemas, fake implementations and autograd are the same in both modes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.library import custom_op

from ._op_utils import CALLS
from ._utils import interpreting

ENV_VAR = "ADAPT_KERNEL_OPS"
MODES = ("opaque", "inductor")


def requested_mode() -> str:
    """The mode ``ADAPT_KERNEL_OPS`` asks for (``opaque`` when unset); a value outside ``MODES`` is an error."""
    value = os.environ.get(ENV_VAR, "").strip().lower() or "opaque"
    if value not in MODES:
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: expected one of {', '.join(MODES)}")
    return value


def effective_mode() -> str:
    """The requested mode, except ``opaque`` whenever Triton's CPU interpreter runs the kernels."""
    mode = requested_mode()  # a bad value is an error here too
    return "opaque" if interpreting() else mode


MODE = effective_mode()


def launch(kernel: Any) -> Any:
    """``kernel`` as the launch code indexes it with its grid: through ``wrap_triton`` in ``inductor`` mode, so a
    trace records the launch as a ``triton_kernel_wrapper`` node; the plain kernel otherwise (no wrapper cost)."""
    if MODE == "inductor":
        return torch.library.wrap_triton(kernel)
    return kernel


def _traced(args: tuple[Any, ...]) -> bool:
    """True while a trace runs the body (FakeTensor or FunctionalTensor arguments): ``CALLS`` counts executions."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return any(isinstance(arg, (FakeTensor, FunctionalTensor)) for arg in args)


def kernel_op(name: str, *, kernels: Sequence[Any]) -> Callable[[Callable[..., Any]], Any]:
    """Register ``fn`` as the functional operator ``name`` in this process's mode; the body counts its real runs.

    ``kernels`` are the Triton kernels the body launches.  In ``inductor`` mode they key AOTAutograd's on-disk
    cache, which otherwise finds kernels only by reading ``wrap_triton(...)`` calls in the body's own source, and
    would serve a graph compiled against an older kernel after its source changed.  Register the fake with the
    returned op's ``register_fake`` as usual: in ``inductor`` mode it replaces the body that ``triton_op``
    registers as the fake, so both modes propagate shapes with the same function.
    """
    short = name.split("::", 1)[1]

    def register(fn: Callable[..., Any]) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if MODE == "opaque" or not _traced(args):  # an opaque body only ever runs for real
                CALLS[short] += 1
            return fn(*args, **kwargs)

        if MODE == "opaque":
            return custom_op(name, counted, mutates_args=())
        op = torch.library.triton_op(name, counted, mutates_args=())
        # private: the table AOTAutograd's cache key reads (torch._library.triton.get_triton_kernels_for_op)
        torch._library.triton.triton_ops_to_kernels[name] = list(kernels)
        return op

    return register
