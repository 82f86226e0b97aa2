"""The operators stage end to end: ``run_ops(src) -> OpsReport`` (used by ``adapt ops`` and ``adapt run``).

source -> model (real weights, or meta for config-only) -> OpInventory -> Recognition -> KernelPlan
-> (real weights only) generated-kernel capture, ONNX export, and a patch check: the plan is applied
to the model, logits and gradients are compared with the unpatched model on fresh inputs, and the
patch is reverted.  ``OpsReport.phases`` says where the stage's seconds went (``device_init``: creating the
process's CUDA context, apart from loading); ``OpsReport`` and its JSON
form, both ways, live in ``operators.ops_report``.

``adapt_model`` turns a model into its adapted configuration: ``apply_kernel_plan`` (every kernel decision:
patched forwards and measured attention backends), then the plan's recomputation and compilation.  The
end-to-end benchmark calls it; the throughput stage and the trainer apply the same two parts themselves
(``apply_kernel_plan``, then ``compile_as_planned`` or the trainer's per-block compile, which must run
between tensor parallelism and FSDP), so each measures the configuration the plan describes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adapt.core.jsonio import atomic_write_text
from adapt.core.spec import ModelSpec
from adapt.core.verdicts import gradient_floor
from adapt.model.calls import without_cache
from operators.agreement import compare_with_spec
from operators.check_cache import cached_onnx, cached_patch_check
from operators.generated import CANNOT_CAPTURE, GeneratedKernel, capture_code, save_sources
from operators.inventory import ModuleRecord, OnnxReport, OpInventory, example_batch, trace_model
from operators.mapping import KernelPlan, for_compile_mode, plan_kernels
from operators.meta_trace import trace_meta_model
from operators.ops_report import OpsReport, PatchCheck
from operators.patch import PatchHandle, apply_kernel_plan
from operators.positions import derived_positions_in_training
from operators.profiles import BackendProfile, load_profile
from operators.recognition import recognise
from operators.recognition.probe_cache import ProbeCache, structure_key
from operators.recompute import checkpoint_blocks
from operators.registry import Target
from operators.timing_cache import DiskCache, device_label

PATCH_RTOL = 1e-5  # float32 logits/gradients of patched vs unpatched model


def build_inventory(
    model_or_spec: Any, *, seq_len: int = 24, backward: bool = True, trust_remote_code: bool = False
) -> OpInventory:
    """Trace a model: real weights -> forward+backward ATen inventory; meta -> one block per structure.

    Accepts an ``nn.Module``, a ``ModelSource``, or a ``ModelSpec`` (its ``source`` is re-read config-only).
    """
    model = model_or_spec
    if isinstance(model_or_spec, ModelSpec):
        from adapt.model.intake import build_meta_model, resolve_source

        source = resolve_source(model_or_spec.source, config_only=True, trust_remote_code=trust_remote_code)
        model = build_meta_model(source)
    elif not isinstance(model_or_spec, nn.Module):
        from adapt.model.intake import build_meta_model

        model = build_meta_model(model_or_spec)
    if next(model.parameters()).device.type == "meta":
        return trace_meta_model(model)
    return trace_model(model, seq_len=seq_len, backward=backward)


def default_target() -> Target:
    """This machine, in the dtype ``adapt run`` trains in there."""
    return Target.here(dtype="bfloat16" if torch.cuda.is_available() else "float32")


def ops_environment(target: Target | None = None) -> dict[str, Any]:
    """What an operators result depends on besides the checkpoint and the options: the target ``run_ops``
    plans for here, the device's name and the torch/triton/transformers/adapt versions.  A stored result
    is reused only where this is unchanged (the pipeline puts it in the stage's cache key)."""
    from operators.timing_cache import environment

    tgt = target or default_target()
    return {"target": tgt.to_dict(), **environment(tgt.device)}


def run_ops(
    src: Any,
    profile: str | BackendProfile | None = None,
    out_dir: str | Path | None = None,
    *,
    target: Target | None = None,
    onnx: bool = True,
    check_patch: bool = True,
    trust_remote_code: bool = False,
    config_only: bool = False,
    compile_mode: str | None = None,
    spec: ModelSpec | None = None,
) -> OpsReport:
    """The whole operators stage for ``src`` (a path/hub id, or a resolved ``ModelSource``).

    Writes ``ops.json`` (and generated kernel sources, ``model.onnx``) to ``out_dir`` when given.
    ``compile_mode`` overrides how the plan compiles the adapted model (``mapping.compile_plan``).
    With intake's ``spec`` of the same source, the report says where the two descriptions disagree.
    """
    from adapt.model.intake import build_meta_model, load_model, resolve_source

    start = time.perf_counter()
    phases: dict[str, float] = {}
    source = (
        resolve_source(str(src), config_only=config_only, trust_remote_code=trust_remote_code)
        if isinstance(src, (str, Path))
        else src
    )
    label = getattr(source, "text", str(src))
    prof = profile if isinstance(profile, BackendProfile) else load_profile(profile)
    tgt = target or default_target()
    out = Path(out_dir) if out_dir else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    if not source.has_weights:
        with _phase(phases, "load"):
            model = build_meta_model(source)
        with _phase(phases, "trace"):
            inventory = trace_meta_model(model)
        with _phase(phases, "recognise"):
            recognition = recognise(model, inventory, probe=False)
        with _phase(phases, "plan"):
            plan = plan_kernels(inventory, recognition, prof, tgt, compile_mode=compile_mode)
        report = OpsReport(
            label,
            prof,
            tgt,
            inventory,
            recognition,
            plan,
            None,
            patch_check=PatchCheck(False, note="config-only: no weights"),
        )
    else:
        if tgt.device == "cuda" and torch.cuda.is_available():
            with _phase(phases, "device_init"):  # the process's first CUDA context: seconds on a cold GPU, not loading
                torch.empty(1, device="cuda")
                torch.cuda.synchronize()
        with _phase(phases, "load"):
            model = load_model(
                source, dtype=torch.float32, device=tgt.device if tgt.device in ("cpu", "cuda") else "cpu"
            )
        with _phase(phases, "trace"):
            inventory = trace_model(model)
        with _phase(phases, "recognise"):
            recognition = recognise(model, inventory, cache=ProbeCache(DiskCache("probe_verdicts")))
        with _phase(phases, "plan"):
            plan = plan_kernels(inventory, recognition, prof, tgt, model, compile_mode=compile_mode)
        with _phase(phases, "generated"):
            generated, uncompilable = _capture_generated(model, inventory, plan, out)
        if uncompilable:
            with _phase(phases, "plan"):
                plan = plan_kernels(
                    inventory,
                    recognition,
                    prof,
                    tgt,
                    model,
                    compile_mode=compile_mode,
                    as_traced=uncompilable,
                    earlier=plan,
                )
        onnx_report, onnx_blocks = None, None
        if onnx:
            with _phase(phases, "onnx"):
                onnx_report, onnx_blocks = cached_onnx(
                    source, tgt.device, out, lambda path: _onnx(model, inventory, path)
                )
        report = OpsReport(
            label, prof, tgt, inventory, recognition, plan, onnx_report, generated, onnx_blocks=onnx_blocks
        )
        with _phase(phases, "patch_check"):
            report.patch_check = (
                cached_patch_check(source, tgt.device, plan, lambda: check_kernel_plan(model, plan))
                if check_patch
                else PatchCheck(False, note="skipped")
            )
    if spec is not None:
        report.agreement = compare_with_spec(spec, report.recognition, inventory.traced_blocks)
    report.seconds = time.perf_counter() - start
    report.phases = phases
    if out:
        atomic_write_text(out / "ops.json", json.dumps(report.to_dict(), indent=1))
    return report


@contextlib.contextmanager
def _phase(phases: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


def adapt_model(
    model: nn.Module,
    plan: KernelPlan,
    *,
    compile_mode: str | None = None,
    recompute: str = "none",
    cuda_graphs: bool | None = None,
) -> PatchHandle:
    """The adapted configuration of ``model``: the plan's kernels patched in, then compiled as the plan
    says (``compile_mode`` overrides it: "blocks", "whole" or "none"; ``cuda_graphs`` overrides whether the
    compiled code replays as CUDA graphs).  ``handle.revert()`` undoes both.

    "blocks" compiles each repeated block in place (``module.compile()``): identical blocks share one
    compiled graph, and modules outside the blocks (embedding, head, fused loss) stay eager.
    ``recompute`` ("none", "selective", "full"; ``operators.recompute``) is how much of each block's
    activations is recomputed in backward instead of kept: the parallel plan's choice, from its memory model.
    Training forwards that pass only token ids skip transformers' packed-sequence check and its host read
    (``operators.positions``).
    """
    mode = compile_mode or plan.compile.get("mode", "none")
    graphs = plan.compile.get("cuda_graphs", False) if cuda_graphs is None else cuda_graphs
    handle = apply_kernel_plan(model, for_compile_mode(plan, mode))
    try:
        if recompute != "none":
            from adapt.model.blocks import find_blocks

            handle.releases.append(checkpoint_blocks(find_blocks(model), recompute))
            if mode != "blocks":  # (compiled blocks already run uncached while training)
                handle.releases.append(uncached_in_training(model))  # a cache grown in forward breaks the rerun
        handle.releases.extend(compile_as_planned(model, mode, cuda_graphs=graphs and mode != "none"))
        if mode != "whole":  # (a model compiled whole is traced, and transformers skips the check when tracing)
            handle.releases.append(derived_positions_in_training(model))
    except Exception:
        handle.revert()
        raise
    return handle


def compile_as_planned(
    model: nn.Module, mode: str, backend: str | Callable = "inductor", *, cuda_graphs: bool = False
) -> list[Callable[[], None]]:
    """Compile ``model`` in place the way a plan's compile mode says; returns the undo callables.

    For callers that patch through their own transform and need only the plan's compilation on top.
    "blocks" also runs the model uncached while it trains (``uncached_in_training``): one compiled graph
    then serves every block instead of one per layer.  ``cuda_graphs`` replays each compiled graph as a CUDA
    graph (Inductor's "reduce-overhead" mode, CUDA graph trees): one launch per graph instead of one per kernel.
    """
    undo: list[Callable[[], None]] = []
    if mode == "blocks":
        from adapt.model.blocks import find_blocks

        targets = list(find_blocks(model))
        undo.append(uncached_in_training(model))
    elif mode == "whole":
        targets = [model]
    elif mode == "none":
        targets = []
    else:
        raise ValueError(f"compile mode must be blocks, whole or none, not {mode!r}")
    if cuda_graphs and backend != "inductor":
        raise ValueError(f"CUDA graphs need the inductor backend, not {backend!r}")
    options = {"mode": "reduce-overhead"} if cuda_graphs else {"backend": backend}
    for module in targets:
        module.compile(**options)
    return undo + [functools.partial(_uncompile, module) for module in targets]


def uncached_in_training(model: nn.Module) -> Callable[[], None]:
    """Turn the KV cache off for forward calls made in training mode that do not ask for it; returns the undo.

    A training step never reads the cache, yet transformers builds one by default, and each attention
    layer then indexes it by its own layer number.  A block compiled on its own is guarded on that
    number, so it recompiles for every layer and runs eagerly past Dynamo's recompile limit.
    """
    keyword = without_cache(model)
    if not keyword:
        return lambda: None

    def drop_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if module.training and kwargs.get("use_cache") is None:
            return args, {**kwargs, **keyword}
        return None

    return model.register_forward_pre_hook(drop_cache, with_kwargs=True).remove


def _uncompile(module: nn.Module) -> None:
    module._compiled_call_impl = None


def _capture_generated(
    model: nn.Module, inv: OpInventory, plan: KernelPlan, out: Path | None
) -> tuple[list[GeneratedKernel], dict[str, str]]:
    """Inductor's code for each generated module, compiled once per interchangeable structure
    (``probe_cache.structure_key``: same classes, parameters, attributes, traced ops and call inputs) and kept
    across runs like a probe's verdict (the same code identities, plus the device and dtype), so a warm run
    compiles nothing here; the report names the module each capture was made on.  Also returns the new components
    Dynamo could not capture as one graph, each with the reason's first line."""
    captures = ProbeCache(DiskCache("generated_code"))
    kernels: list[GeneratedKernel] = []
    uncompilable: dict[str, str] = {}
    saved: dict[str, list[str]] = {}  # source files written in this run, by the module their capture was made on
    for choice in plan.components:
        if choice.status != "generated" or choice.module not in inv.captured:
            continue
        module = model.get_submodule(choice.module)
        args, kwargs = inv.captured[choice.module]
        key = capture_key(module, inv.modules[choice.module], inv, args)
        code, _ = captures.verdict(
            key, choice.module, functools.partial(_capture_or_refusal, module, choice, args, kwargs)
        )
        if "refused" in code:
            uncompilable[choice.module] = code["refused"]
            continue
        first = captures.answers[-1]
        compiled_here = first.probed_on == choice.module and not first.earlier_run
        if first.probed_on not in saved:
            saved[first.probed_on] = save_sources(code["sources"], first.probed_on, out)
        kernel = GeneratedKernel(
            choice.module,
            code["language"],
            code["kernels"],
            saved[first.probed_on],
            code["compile_seconds"] if compiled_here else 0.0,
            len("\n".join(code["sources"])),
            reused_from=None if first.probed_on == choice.module else first.probed_on,
            earlier_run=first.earlier_run,
        )
        kernels.append(kernel)
    return kernels, uncompilable


def capture_key(module: nn.Module, rec: ModuleRecord, inv: OpInventory, args: tuple) -> tuple:
    """What a generated module's Inductor code depends on: its structure (``probe_cache.structure_key``) and the
    device and dtype it compiles for, read from its first parameter, else buffer, else input tensor (a rotary
    module has no parameters, and Inductor writes C++ for it on the CPU, Triton on a GPU)."""
    from torch.utils._pytree import tree_leaves

    tensors = (t for t in (*module.parameters(), *module.buffers(), *tree_leaves(args)) if isinstance(t, torch.Tensor))
    where = next(tensors, None)
    target = (
        ("inductor code", device_label(str(where.device)), str(where.dtype))
        if where is not None
        else ("inductor code",)
    )
    return (*structure_key(module, rec, inv, call_inputs=True), target)


def _capture_or_refusal(module: nn.Module, choice: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``capture_code``, or ``{"refused": reason}`` for a new component Dynamo cannot capture as one graph (a known
    component that cannot be captured is an error)."""
    try:
        return capture_code(module, args, kwargs)
    except CANNOT_CAPTURE as err:
        if choice.kind != "new":
            raise
        return {"refused": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"}


def _onnx(model: nn.Module, inventory: OpInventory, path: Path | None) -> tuple[OnnxReport, dict[str, int] | None]:
    """Export the model with one block of each distinct structure: the same op types as the full depth,
    in a fraction of the time (the exporter's cost grows with every block).  Op counts are for that depth."""
    from operators.onnx_export import export_onnx

    ids = example_batch(model, 2, 16, device=next(model.parameters()).device)
    with _distinct_blocks_only(model, inventory) as depth:
        report = export_onnx(model, ids, path)
    return report, depth


@contextlib.contextmanager
def _distinct_blocks_only(model: nn.Module, inventory: OpInventory) -> Iterator[dict[str, int] | None]:
    """Temporarily replace the model's block list by its first block of each structure (``probe_cache.structure_key``)."""
    from adapt.model.blocks import NoBlockList, find_blocks
    from operators.recognition.probe_cache import structure_key

    try:
        found = find_blocks(model)
    except NoBlockList:
        yield None
        return
    path, blocks = found.path, model.get_submodule(found.path)  # the container itself, put back afterwards
    seen, keep = set(), []
    for i, block in enumerate(blocks):
        record = inventory.modules.get(f"{path}.{i}")
        key = structure_key(block, record, inventory) if record is not None else ("untraced", i)
        if key not in seen:
            seen.add(key)
            keep.append(block)
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, nn.ModuleList(keep))
    try:
        yield {"exported": len(keep), "of": len(blocks)}
    finally:
        setattr(parent, attr, blocks)


def check_kernel_plan(model: nn.Module, plan: KernelPlan, *, seed: int = 1234) -> PatchCheck:
    """Apply ``plan``, compare float32 logits and gradients against the unpatched model, revert."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    ids = example_batch(model, 2, 20, device=next(model.parameters()).device)
    torch.random.set_rng_state(generator_state)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    training = bool(plan.target.get("training", True))  # inference plans may hold forward-only kernels
    ref_out, ref_grads = _forward_backward(model, ids, training)
    handle = apply_kernel_plan(model, plan)
    try:
        out, grads = _forward_backward(model, ids, training)
        calls = handle.attention_calls()
        fusion = handle.residual_fusion()
        patched = len(handle.patched)
        unchanged = model.state_dict().keys() == before.keys() and all(
            torch.equal(before[k], v) for k, v in model.state_dict().items()
        )
    finally:
        handle.revert()
    again, _ = _forward_backward(model, ids, training)
    logits_diff = float((out - ref_out).abs().max())
    grad_rel = gradient_mismatch(ref_grads, grads)
    scale = max(float(ref_out.abs().max()), 1.0)
    # every fused add+norm pair must have served its norm: a pair that ran unfused would be a silent fallback
    fused_all = fusion["idle"] == 0 and fusion["missed"] == 0
    passed = (
        logits_diff <= PATCH_RTOL * scale
        and grad_rel <= 1e-4
        and unchanged
        and torch.equal(again, ref_out)
        and fused_all
    )
    return PatchCheck(
        True, passed, logits_diff, grad_rel, unchanged, bool(torch.equal(again, ref_out)), calls, patched, fusion
    )


def gradient_mismatch(reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor]) -> float:
    """The largest per-parameter max-abs gradient difference, relative to the reference gradient's largest entry.

    A gradient that is zero in exact arithmetic holds only float32 rounding, which scales with the global gradient
    norm: each is measured against at least the floor the alignment stage uses (``gradient_floor``), so rounding is
    never read as a mismatch.  A parameter whose gradient vanished from ``candidate`` (a term a kernel dropped) is a
    mismatch (infinite).
    """
    if set(reference) - set(candidate):
        return float("inf")
    floor = gradient_floor(float(g.double().norm()) for g in reference.values()) or 1e-12
    return max(
        (float((candidate[k] - g).abs().max()) / max(float(g.abs().max()), floor) for k, g in reference.items()),
        default=0.0,
    )


def _forward_backward(
    model: nn.Module, ids: torch.Tensor, training: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    saved = {p: p.grad for p in model.parameters()}
    for p in model.parameters():
        p.grad = None
    try:
        with torch.set_grad_enabled(training):
            # no cache: recurrent and linear-attention layers may hold caches only their own generate() sets up
            out = model(input_ids=ids, **without_cache(model))
        logits = out.logits if getattr(out, "logits", None) is not None else out[0]
        if training:
            logits.float().pow(2).mean().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        for p, g in saved.items():
            p.grad = g
    return logits.detach(), grads
