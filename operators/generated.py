"""Generated kernels: Inductor compiles a module's subgraph and its source is captured for the report.

On CUDA Inductor emits Triton; on CPU it emits C++ with OpenMP.  The captured file is Inductor's own
output module (wrapper plus kernels), found as the new entries in ``PyCodeCache`` after the first
forward and backward of the compiled module.
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from adapt.model.captured import fresh_input

# What a fullgraph compile raises on a forward it cannot capture as one graph: Dynamo's own errors (an unsupported
# construct, a graph break, a backend failure) and a guard on a value known only at run time (a loop over
# ``tensor.unique().tolist()``).
CANNOT_CAPTURE = (torch._dynamo.exc.TorchDynamoException, GuardOnDataDependentSymNode)


@dataclass
class GeneratedKernel:
    module: str
    language: str  # "triton" | "c++/openmp" | "unknown"
    kernels: list[str] = field(default_factory=list)  # kernel function names found in the source
    files: list[str] = field(default_factory=list)  # saved copies beside the report
    compile_seconds: float = 0.0
    source_chars: int = 0
    reused_from: str | None = None  # identical module whose Inductor code this one reuses
    earlier_run: bool = False  # the code was captured in an earlier run (adapt's cache): nothing compiled in this one


def compile_module(
    module: nn.Module, name: str = "", on_fallback: Callable[[str], None] | None = None
) -> Callable[..., Any]:
    """Inductor-compiled version of ``module``'s *original* forward (bound to the module).

    ``dynamic=None`` lets dynamo mark a dimension dynamic after its first change, so decoding (a new
    sequence length every step) costs one recompile rather than one per length.  Code that specialises on a size
    anyway (RecurrentGemma's scan loops over the sequence in Python) recompiles per length until Dynamo's limit;
    from there the module runs its own forward, said once as a warning and to ``on_fallback`` (the patch handle's
    record), never silently and never as a crash of the caller's decode.  So does a call whose code path Dynamo cannot
    capture whole, met after the plan was made (xLSTM's cached decode raises inside its own code): that call and the
    later ones run the module's forward, which raises the module's own error, if any, for the caller to judge.
    """
    original = type(module).forward.__get__(module)
    compiled = torch.compile(original, backend="inductor", fullgraph=True, dynamic=None)
    running = [compiled]
    label = name or type(module).__name__

    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return running[0](*args, **kwargs)
        except (torch._dynamo.exc.FailOnRecompileLimitHit, torch._dynamo.exc.Unsupported) as err:
            if running[0] is original:
                raise
            running[0] = original
            why = f"{label}: {_uncapturable(err)}; it runs its own forward from here on"
            warnings.warn(why, stacklevel=2)
            if on_fallback is not None:
                on_fallback(why)
            return original(*args, **kwargs)

    return forward


def _uncapturable(err: Exception) -> str:
    """Why a generated kernel gave way, in one clause."""
    if isinstance(err, torch._dynamo.exc.FailOnRecompileLimitHit):
        return (
            "its generated kernel recompiled past Dynamo's limit (the module's code specialises on a size that keeps "
            "changing)"
        )
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    first = lines[0] if lines else type(err).__name__
    # Dynamo names the error the module's code raised in its debug context ("raised exception ValueError(...)")
    context = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Developer debug context:")), "")
    return f"Dynamo cannot capture this call's path whole ({first}{': ' + context if context else ''})"[:240]


@contextlib.contextmanager
def _state_detached(module: nn.Module) -> Iterator[None]:
    """Plain tensor attributes a forward left on the modules (a recurrence's last state) detached for the capture,
    then put back: they belong to the traced model's graph, which its backward freed."""
    saved = [
        (sub, name, value)
        for sub in module.modules()
        for name, value in vars(sub).items()
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
    ]
    for sub, name, value in saved:
        setattr(sub, name, value.detach())
    try:
        yield
    finally:
        for sub, name, value in saved:
            setattr(sub, name, value)


def capture_code(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Compile ``module``, run it forward and backward once on fresh inputs shaped like ``args``, and return
    Inductor's code: ``language``, ``kernels`` (function names), ``sources`` (each output module's text) and
    ``compile_seconds``.  Plain JSON, so that a later run can take it from a cache instead of compiling."""
    from torch._inductor.codecache import PyCodeCache

    fn = compile_module(module)
    before = {id(m) for m in PyCodeCache.modules}
    start = time.perf_counter()
    fresh = [
        torch.randn_like(a).requires_grad_(a.is_floating_point())
        if isinstance(a, torch.Tensor) and a.is_floating_point()
        else fresh_input(a)
        for a in args
    ]
    # Captured tensors anywhere else (keywords, nested in tuples and mappings) belong to the traced model's graph,
    # freed by its backward: detached, and their containers copied, so this call neither reaches that graph nor
    # changes the capture.
    kwargs = fresh_input(kwargs)
    with _state_detached(module):
        out = fn(*fresh, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.float().sum().backward()
    elapsed = time.perf_counter() - start
    new = [m for m in PyCodeCache.modules if id(m) not in before and getattr(m, "__file__", None)]
    sources = [Path(m.__file__).read_text() for m in new]
    text = "\n".join(sources)
    language = (
        "triton"
        if "@triton.jit" in text
        else ("c++/openmp" if "cpp_fused" in text or 'extern "C"' in text else "unknown")
    )
    names = sorted(set(re.findall(r"\b(cpp_fused_\w+|triton_\w+)\b", text)))
    return {"language": language, "kernels": names, "sources": sources, "compile_seconds": round(elapsed, 3)}


def save_sources(sources: list[str], path: str, out_dir: str | Path | None) -> list[str]:
    """Copies of the captured sources beside the report (``OUT/generated/<module>_<i>.py``)."""
    if out_dir is None or not sources:
        return []
    target = Path(out_dir) / "generated"
    target.mkdir(parents=True, exist_ok=True)
    files = []
    for i, src in enumerate(sources):
        dest = target / f"{path.replace('.', '_')}_{i}.py"
        dest.write_text(src)
        files.append(str(dest))
    return files
