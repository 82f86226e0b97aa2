"""The adapted model under parallelism: adapt's kernel plan and per-block compilation on each chunk.

``parallelize`` calls these in torchtitan's order, per pipeline chunk: tensor/sequence parallelism,
then the kernel plan (patched forwards look their parameters up on every call, so they see the
DTensors TP left), activation checkpointing, ``torch.compile`` per block, FSDP last.

Kernels and DTensors.  Under tensor parallelism a row-wise module the plan patches (a norm on the
sequence-sharded stream, a per-head norm on head-sharded queries/keys) is placed with
``LocalRowsParallel``: its parameters become replicated DTensors, its activations stay this rank's
plain rows.  The patched forward then runs the kernel on local views of the parameters, whose
gradients come back as partial sums over the ranks -- what DTensor's own norm rule gives.  A patched
module whose parameters another TP style sharded runs its unpatched forward through DTensor
dispatch, counted, never silent.  Components that cannot apply to a layout at all (the fused loss
when the pipeline or TP computes the loss, a residual fusion whose norm holds DTensors or sits
inside a compiled graph, MoE kernels when expert parallelism owns the experts) are left out up
front, each with its reason.

Compilation.  Each block is compiled in place (``nn.Module.compile``: parameter names unchanged),
so DTensor dispatch and the TP hooks are paid once at trace time.  Where Triton runs in its CPU
interpreter, dynamo cannot trace a kernel launch: patched modules then run outside the graph
(``torch.compiler.disable``), counted, and one that holds TP linears is left out (DTensor autograd
does not survive an eager island inside a compiled block).  Async TP (collectives overlapped with the matmuls by
Inductor's micro-pipelining over symmetric memory) is switched on for CUDA + NCCL + Inductor only.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from adapt.core.errors import BadInput

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass
class AdaptOptions:
    """How the adapted model is realised on each chunk."""

    kernel_plan: Any = None  # operators.KernelPlan for this architecture; None runs the model's own modules
    compile: str | None = None  # torch.compile backend per block (COMPILE_BACKENDS), None for eager
    async_tp: bool = True  # where torch provides it (CUDA, NCCL, Inductor, sequence parallelism)
    kernel_regions: str = "auto"  # "inline" | "opaque" | "auto" (opaque where Triton is interpreted)

    def __post_init__(self) -> None:
        if self.compile is not None and self.compile not in COMPILE_BACKENDS:
            raise BadInput(f"compile backend must be one of {', '.join(COMPILE_BACKENDS)}, not {self.compile!r}")
        if self.kernel_regions not in ("inline", "opaque", "auto"):
            raise BadInput(f"kernel_regions must be inline, opaque or auto, not {self.kernel_regions!r}")


@dataclass
class LocalShardCounts:
    """Calls of patched modules that met DTensor inputs: run on local shards, or fell back (why)."""

    local: int = 0
    fallback: int = 0
    reasons: Counter = field(default_factory=Counter)


@dataclass
class AdaptedReport:
    """What the kernel plan and compilation did on this rank (all chunks together)."""

    patched: list[str] = field(default_factory=list)
    left_out: list[tuple[str, str]] = field(default_factory=list)  # (component, reason)
    dtensor_modules: int = 0  # patched modules guarded for DTensor inputs
    opaque_modules: int = 0  # patched modules run outside the compiled graph
    compiled_blocks: int = 0
    compile_backend: str | None = None
    async_tp: str = "off"  # "on" or why not
    counts: LocalShardCounts = field(default_factory=LocalShardCounts)
    handles: list[Any] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "patched": len(self.patched), "left_out": [f"{c}: {r}" for c, r in self.left_out],
            "dtensor_modules": self.dtensor_modules, "opaque_modules": self.opaque_modules,
            "compiled_blocks": self.compiled_blocks, "compile_backend": self.compile_backend, "async_tp": self.async_tp,
            "local_shard_calls": self.counts.local, "fallback_calls": self.counts.fallback,
            "fallback_reasons": dict(self.counts.reasons),
        }  # fmt: skip


def _present(module: nn.Module, path: str | None) -> bool:
    if path is None:
        return False
    try:
        return isinstance(module.get_submodule(path), nn.Module)
    except AttributeError:
        return False


def restrict_kernel_plan(
    kernel_plan: Any, chunk: nn.Module, plan: Any, compiling: bool, opaque: bool = False
) -> tuple[Any, list[tuple[str, str]]]:
    """The components of ``kernel_plan`` this chunk holds and this layout can run; the rest with a reason.

    ``opaque``: patched modules will run outside the compiled graph.  One that holds tensor-parallel
    submodules is left out: DTensor autograd does not survive an eager island inside a compiled block.
    """
    keep, left_out = [], []
    for choice in kernel_plan.components:
        if not choice.patch:
            continue
        where = [choice.module] + ([choice.variant.add_in] if choice.kind == "residual_add_norm" else [])
        if not all(_present(chunk, p) for p in where):
            continue  # another pipeline stage holds it
        reason = _layout_refusal(choice, plan, compiling)
        if reason is None and opaque and _holds_tp_submodules(chunk.get_submodule(choice.module)):
            reason = "the kernel cannot be traced here (Triton interpreter) and the module holds TP linears"
        if reason:
            left_out.append((f"{choice.module}: {choice.kind}", reason))
        else:
            keep.append(choice)
    return dataclasses.replace(kernel_plan, components=keep), left_out


def _layout_refusal(choice: Any, plan: Any, compiling: bool) -> str | None:
    if choice.kind == "lm_head_cross_entropy":
        if plan.pp > 1:
            return "the pipeline schedule computes the loss from the last stage's logits"
        if plan.tp > 1 or plan.cp > 1:
            return "tp/cp compute the loss from (sharded) logits; the fused head takes whole rows"
    if choice.kind == "residual_add_norm":
        if plan.tp > 1 and plan.sequence_parallel:
            return "the norm holds DTensors under sequence parallelism; the fused add takes plain tensors"
        if compiling:
            return "its TorchFunctionMode window cannot be traced into a compiled block"
    if choice.kind in ("moe", "routed_experts") and plan.ep > 1:
        return "expert parallelism owns the experts' forward"
    if choice.status == "generated" and plan.tp > 1:
        return "an Inductor-generated module cannot take DTensor parameters"
    return None


def _holds_tp_submodules(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for child in module.children() for p in child.parameters())


def _own_dtensors(module: nn.Module) -> dict[str, DTensor]:
    return {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}


ROW_KINDS = ("rms_norm", "layer_norm")


def local_row_modules(kernel_plan: Any, plan: Any, compiling: bool) -> frozenset[str]:
    """Row-wise modules the kernel plan patches: under TP they keep local activations (``LocalRowsParallel``)."""
    if kernel_plan is None:
        return frozenset()
    return frozenset(
        c.module for c in kernel_plan.components
        if c.patch and c.kind in ROW_KINDS and _layout_refusal(c, plan, compiling) is None
    )  # fmt: skip


def _unpatched_forward(module: nn.Module, previous: Any):
    """The forward the patch replaced: an earlier instance forward, else the class's own."""
    return previous if callable(previous) else type(module).forward.__get__(module)


def guard_dtensor_inputs(module: nn.Module, patched, unpatched, counts: LocalShardCounts):
    """``module``'s patched forward where its own parameters are DTensors.

    A ``LocalRowsParallel`` module (replicated parameters, this rank's rows as a plain tensor) runs
    the kernel on local views of its parameters; their gradients are partial sums over the ranks.
    Anything else runs the unpatched forward through DTensor dispatch, counted.
    """
    rows_mesh = getattr(module, "_adapt_rows_mesh", None)

    @torch.compiler.disable  # swaps the module's parameters for local views while the kernel runs
    def forward(x, *args, **kwargs):
        params = _own_dtensors(module)
        if rows_mesh is None or isinstance(x, DTensor):
            reason = "DTensor input" if isinstance(x, DTensor) else "parameters sharded by another TP style"
            counts.fallback += 1
            counts.reasons[reason] += 1
            return unpatched(x, *args, **kwargs)
        saved = dict(module._parameters)
        try:
            for name, param in params.items():
                module._parameters[name] = param.to_local(grad_placements=[Partial()] * rows_mesh.ndim)
            out = patched(x, *args, **kwargs)
        finally:
            module._parameters.update(saved)
        counts.local += 1
        return out

    return forward


def kernels_traceable(device: torch.device) -> bool:
    """Dynamo traces Triton launches on a GPU, not inside Triton's CPU interpreter."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def apply_kernels(
    chunk: nn.Module, plan: Any, options: AdaptOptions, device: torch.device, report: AdaptedReport
) -> None:
    """Install the chunk's share of the kernel plan and make every patched forward layout-safe."""
    from operators import apply_kernel_plan

    compiling = options.compile is not None
    opaque = compiling and (
        options.kernel_regions == "opaque" or (options.kernel_regions == "auto" and not kernels_traceable(device))
    )
    restricted, left_out = restrict_kernel_plan(options.kernel_plan, chunk, plan, compiling, opaque)
    report.left_out += left_out
    handle = apply_kernel_plan(chunk, restricted)
    report.handles.append(handle)
    report.patched += handle.patched
    for module, previous in handle.forwards:
        patched = module.forward
        if _own_dtensors(module):
            module.forward = guard_dtensor_inputs(module, patched, _unpatched_forward(module, previous), report.counts)
            report.dtensor_modules += 1
        elif opaque:
            module.forward = torch.compiler.disable(patched)
            report.opaque_modules += 1


def compile_blocks(blocks: nn.Module, backend: str, report: AdaptedReport) -> None:
    """Compile each block in place (after activation checkpointing, before FSDP), as torchtitan does.

    Blocks share their code: a block whose guards differ (an integer attribute such as a layer
    index) adds a cache entry, and past dynamo's recompile limit it would silently run eagerly, so
    the limit is raised to cover every block.
    """
    import torch._dynamo.config as dynamo_config

    children = list(blocks.children())
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), 2 * len(children)))
    for block in children:
        block.compile(backend=backend, fullgraph=False)
        report.compiled_blocks += 1
    report.compile_backend = backend


def enable_async_tp(tp_mesh: DeviceMesh, device: torch.device, options: AdaptOptions, sequence_parallel: bool) -> str:
    """Switch on Inductor's micro-pipelined TP for the tp group; returns "on" or why it stays off."""
    if not options.async_tp:
        return "off: not requested"
    if device.type != "cuda" or options.compile != "inductor" or not sequence_parallel:
        return "off: needs CUDA, the inductor backend and sequence parallelism"
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "_micro_pipeline_tp"):
        return "off: this torch has no micro-pipelined TP"
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    except ImportError:
        return "off: this torch has no symmetric memory"
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    inductor_config._micro_pipeline_tp = True
    return "on"
