"""Streamed alignment: one block at a time, straight from the safetensors shards.

The reference model is a skeleton (parameters on meta, buffers real) whose blocks are
materialised just before they run and released just after, by forward hooks.  When reference
block ``i`` has run, the baseline and candidate copies of block ``i`` are materialised, fed the
*same* inputs (hidden states and the exact keyword arguments the model passed: masks, rotary
tables, cache positions), compared, and released.  Modules outside the block list (embeddings,
final norm, head) are materialised once and compared the same way.  Peak memory is the
out-of-block weights plus about three copies of one block, whatever the depth: this is how a
checkpoint bigger than memory is aligned on one machine.  Checkpoints that transformers converts
while loading (per-expert tensors stacked into banks, renamed keys) are read through transformers'
own conversion mapping (``validators.shards``), one block's tensors at a time.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from adapt.core.errors import BadInput
from adapt.model.blocks import residual_width
from adapt.model.calls import without_cache
from adapt.model.skeleton import build_skeleton, loop_experts
from validators.alignment import AlignmentReport, finish_report, float64_forward, peak_rss_bytes, reference_dtype
from validators.compare import Thresholds, judge, parse_dtype
from validators.modules import (
    NonFiniteOutput,
    Probe,
    components,
    find_blocks,
    first_tensor,
    stop_on_nonfinite,
)
from validators.shards import CorruptWeights, ShardReader
from validators.training import batch_for_step, vocab_size


class Materialiser:
    """Loads and releases the parameters (and checkpointed buffers) under one module of one model copy."""

    def __init__(self, model: nn.Module, reader: ShardReader, dtype: torch.dtype, device: str):
        self.model, self.reader, self.dtype, self.device = model, reader, dtype, device
        # Tied parameters appear under several names; group the owners of each parameter object.
        self.owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
        for mod_name, module in model.named_modules():
            for leaf, param in module._parameters.items():
                if param is not None:
                    full = f"{mod_name}.{leaf}" if mod_name else leaf
                    self.owners.setdefault(id(param), []).append((module, leaf, full))
        self.meta: dict[str, nn.Parameter] = {}

    def _entries(self, prefix: str) -> Iterator[tuple[list[tuple[nn.Module, str, str]], nn.Parameter]]:
        seen = set()
        for owners in list(self.owners.values()):
            module, leaf, _ = owners[0]
            param = module._parameters[leaf]
            if any(full.startswith(prefix) for _, _, full in owners) and id(param) not in seen:
                seen.add(id(param))
                yield owners, param

    def load(self, prefix: str) -> None:
        """Every parameter under ``prefix`` (tied ones by any of their names), converted as transformers would."""
        entries = list(self._entries(prefix))
        names = {full for owners, _ in entries for _, _, full in owners}
        tensors = self.reader.load(sorted(names & self.reader.targets.keys()))
        for owners, meta_param in entries:
            name = next((full for _, _, full in owners if full in tensors), None)
            if name is None:
                raise BadInput(
                    f"streamed loading: the checkpoint holds no tensor for {owners[0][2]}, stored or converted"
                )
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(meta_param.shape):
                raise BadInput(
                    f"streamed loading: {name} has shape {tuple(tensor.shape)}, model expects {tuple(meta_param.shape)}"
                )
            real = nn.Parameter(tensor.to(self.device, self.dtype), requires_grad=False)
            for module, leaf, full in owners:
                self.meta.setdefault(full, meta_param)
                module._parameters[leaf] = real
            self.owners[id(real)] = self.owners.pop(id(meta_param))
        self.load_buffers(prefix)

    def load_buffers(self, prefix: str) -> None:
        """Checkpointed buffers under ``prefix`` from the shards; computed ones just move to the device."""
        for name, buf in list(self.model.named_buffers()):
            if not name.startswith(prefix):
                continue
            module_path, _, leaf = name.rpartition(".")
            owner = self.model.get_submodule(module_path)
            if name in self.reader.targets:
                value = self.reader.load([name])[name]
                owner._buffers[leaf] = value.to(self.device, self.dtype if value.is_floating_point() else value.dtype)
            elif buf.device.type != self.device:
                owner._buffers[leaf] = buf.to(self.device)

    def release(self, prefix: str) -> None:
        for owners, param in list(self._entries(prefix)):
            meta_param = self.meta[owners[0][2]]
            for module, leaf, _ in owners:
                module._parameters[leaf] = meta_param
            self.owners[id(meta_param)] = self.owners.pop(id(param))


def _cast(value: Any, dtype: torch.dtype, device: str) -> Any:
    """Move block inputs to a twin's dtype/device; masks keep their meaning (clamped to the finite range)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            info = torch.finfo(dtype)
            return value.to(torch.float64).clamp(info.min, info.max).to(device, dtype)
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype, device) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype, device) for k, v in value.items()}
    return value


class _Twin:
    def __init__(self, model: nn.Module, reader: ShardReader, dtype: torch.dtype, device: str):
        self.model = model
        self.dtype, self.device = dtype, device
        self.loader = Materialiser(model, reader, dtype, device)
        self.blocks = find_blocks(model)

    def run(self, path: str, module: nn.Module, args, kwargs, probes: list[tuple[Probe, nn.Module]], guard: bool):
        """Run ``module`` (the twin of a reference module) on cast inputs; return output and probe outputs."""
        captured: dict[str, torch.Tensor] = {}
        handles = [m.register_forward_hook(_keep_output(captured, p.name)) for p, m in probes]
        try:
            with torch.no_grad(), float64_forward(module):  # a no-op unless this twin is the float64 reference
                if guard:
                    with stop_on_nonfinite(module):
                        out = module(*_cast(args, self.dtype, self.device), **_cast(kwargs, self.dtype, self.device))
                else:
                    out = module(*_cast(args, self.dtype, self.device), **_cast(kwargs, self.dtype, self.device))
        except NonFiniteOutput as err:
            raise NonFiniteOutput(f"{path}.{err.module_path}" if err.module_path else path) from None
        finally:
            for h in handles:
                h.remove()
        return first_tensor(out), captured


def streamed_align(
    src, dtype_name: str, device: str, limits: Thresholds, transform, options, seed: int
) -> AlignmentReport:
    started = time.perf_counter()
    dtype = parse_dtype(dtype_name)
    skeleton = build_skeleton(src)
    ref_dtype = reference_dtype(residual_width(skeleton), options.reference_dtype, dtype)
    notes: list[str] = []
    try:
        report = _run(src, skeleton, ref_dtype, dtype, dtype_name, device, limits, transform, options, seed)
    except RuntimeError as err:
        if ref_dtype != torch.float64 or isinstance(err, NonFiniteOutput):
            raise
        notes.append(f"float64 reference failed ({str(err).splitlines()[0]}); reference runs in float32")
        report = _run(
            src, build_skeleton(src), torch.float32, dtype, dtype_name, device, limits, transform, options, seed
        )
    report.notes[:0] = notes
    finish_report(report, started)
    return report


def _run(src, skeleton, ref_dtype, dtype, dtype_name, device, limits, transform, options, seed) -> AlignmentReport:
    reader = ShardReader(src, skeleton)
    baseline_model = copy.deepcopy(skeleton)
    candidate_model = copy.deepcopy(skeleton)
    if transform is not None:
        candidate_model = transform(candidate_model) or candidate_model
    reference = _Twin(skeleton, reader, ref_dtype, "cpu")
    twins = {
        "baseline": _Twin(baseline_model, reader, dtype, device),
        "candidate": _Twin(candidate_model, reader, dtype, device),
    }
    report = AlignmentReport(
        source=src.text,
        dtype=dtype_name,
        device=device,
        reference_dtype=str(ref_dtype).removeprefix("torch."),
        streamed=True,
        seed=seed,
        thresholds=limits.to_dict(),
    )
    if ref_dtype == torch.float64:  # the copies above keep the model's own expert kernels
        loop_experts(skeleton, report.notes)
    block_prefixes = [f"{reference.blocks.block_path(i)}." for i in range(len(reference.blocks.blocks))]
    units = _outside_units(skeleton, reference.blocks.path)
    handles = []
    for path in units:
        handles.append(_hook_unit(path, skeleton.get_submodule(path), twins, report, limits))
    for i, block in enumerate(reference.blocks.blocks):
        handles += _hook_block(i, block, block_prefixes[i], reference, twins, report, limits)
    vocab = vocab_size(skeleton)
    ids = batch_for_step(seed, 0, options.batch, options.seq_len, vocab, "cpu")
    try:
        # Weights outside the blocks (embeddings, final norm, head) stay resident for the whole run.
        for twin in (reference, *twins.values()):
            for path in units:
                twin.loader.load(f"{path}.")
            twin.loader.load_buffers("")
        with torch.no_grad():
            skeleton(input_ids=ids, **without_cache(skeleton))
    except NonFiniteOutput as err:
        report.nonfinite_module = err.module_path
        report.notes.append(str(err))
    except CorruptWeights as err:
        _locate(report, err.module_path, reference.blocks)
        report.nonfinite_module, report.corrupt_tensor = err.module_path, err.key
        report.notes.append(f"{err}; the checkpoint itself is corrupt, nothing after it was compared")
    finally:
        for h in handles:
            h.remove()
    report.notes.append(f"peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")
    return report


def _locate(report: AlignmentReport, module_path: str, blocks) -> None:
    """Name ``module_path`` as the first divergence, with its block index and component."""
    report.first_divergent = module_path
    for index in range(len(blocks.blocks)):
        prefix = blocks.block_path(index) + "."
        if module_path.startswith(prefix):
            report.first_divergent_block = index
            report.first_divergent_component = module_path[len(prefix) :].split(".", 1)[0]


def _outside_units(model: nn.Module, blocks_path: str) -> list[str]:
    """Modules outside the block list that own parameters directly (embeddings, final norm, head)."""
    units = []
    for path, module in model.named_modules():
        inside = path == blocks_path or path.startswith(blocks_path + ".")
        if path and not inside and any(p is not None for p in module._parameters.values()):
            units.append(path)
    return units


def _hook_unit(path: str, module: nn.Module, twins: dict[str, _Twin], report: AlignmentReport, limits: Thresholds):
    def hook(_module, args, kwargs, output):
        ref = first_tensor(output)
        outs = {}
        for label, twin in twins.items():
            outs[label], _ = twin.run(path, twin.model.get_submodule(path), args, kwargs, [], label == "candidate")
        report.layers.append(judge(path, None, None, ref, outs["candidate"], outs["baseline"], limits))

    return module.register_forward_hook(hook, with_kwargs=True)


def _hook_block(index, block, prefix, reference: _Twin, twins: dict[str, _Twin], report: AlignmentReport, limits):
    path = prefix[:-1]
    ref_parts: dict[str, torch.Tensor] = {}
    part_probes = [(Probe(f"{path}.{name}", index, name), child) for name, child in components(block)]

    def before(_module, _args, _kwargs):
        reference.loader.load(prefix)
        ref_parts.clear()

    def after(_module, args, kwargs, output):
        results: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        for label, twin in twins.items():
            twin.loader.load(prefix)
            twin_block = twin.model.get_submodule(path)
            probes = [(Probe(f"{path}.{n}", index, n), c) for n, c in components(twin_block)]
            try:
                results[label] = twin.run(path, twin_block, args, kwargs, probes, label == "candidate")
            finally:
                twin.loader.release(prefix)
        reference.loader.release(prefix)
        component_of = {probe.name: probe.component for probe, _ in part_probes}
        for name, ref in ref_parts.items():  # execution order, so the first failure is the first divergence
            if all(name in r[1] for r in results.values()):
                cand, base = results["candidate"][1][name], results["baseline"][1][name]
                report.layers.append(judge(name, index, component_of[name], ref, cand, base, limits))
        report.layers.append(
            judge(path, index, None, first_tensor(output), results["candidate"][0], results["baseline"][0], limits)
        )
        ref_parts.clear()

    handles = [
        block.register_forward_pre_hook(before, with_kwargs=True),
        block.register_forward_hook(after, with_kwargs=True),
    ]
    for probe, child in part_probes:
        handles.append(child.register_forward_hook(_keep_output(ref_parts, probe.name)))
    return handles


def _keep_output(store: dict[str, torch.Tensor], name: str):
    """A forward hook that records a module's first output tensor (and returns None: output unchanged)."""

    def hook(_module, _args, output) -> None:
        store.setdefault(name, first_tensor(output).detach())

    return hook
