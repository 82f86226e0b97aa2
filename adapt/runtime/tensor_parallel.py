"""Tensor (+ sequence) parallelism with ``parallelize_module``, placed from traced structure.

Per block: fan-out linears (q/k/v, gate/up) are colwise, fan-in linears (o, down) rowwise, so one
all-reduce (or, with sequence parallelism, one all-gather + one reduce-scatter) per branch.
Colwise shards are contiguous row ranges, and every shard is a whole number of heads for q and
for k/v, so rank r holds query heads ``[r*H/tp, (r+1)*H/tp)`` and exactly the kv heads those
queries read in GQA: grouping survives the split without replicating kv heads.  HF attention
reshapes with ``-1`` heads, so local head counts need no patching.

With sequence parallelism the residual stream between branches is sharded on the sequence dim
(plain local tensors): per-token modules (norms, pointwise ops) run as ``SequenceParallel``; each
branch gathers its input once (a pre-hook) and the fan-in linear reduce-scatters back.  The embedding output stays full-length (HF derives positions and
masks from it) and the first block takes its sequence shard.

Row-wise modules that adapt's kernel plan patches (``local_rows``) keep their activations plain
local tensors instead (``LocalRowsParallel``): only their parameters become replicated DTensors,
and the patched forward computes on local views of them (``adapted.guard_dtensor_inputs``), so no
DTensor crosses into or out of a kernel.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from adapt.core.errors import BadInput
from adapt.runtime.model_parts import BranchParts, ModelParts


def _first_tensor_position(args: tuple, kwargs: dict) -> int | str | None:
    """Where the hidden stream is: the first tensor among the positional, else the keyword arguments."""
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            return index
    return next((key for key, value in kwargs.items() if isinstance(value, torch.Tensor)), None)


def _replace_stream(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    where = _first_tensor_position(args, kwargs)
    if isinstance(where, int):
        return (*args[:where], fn(args[where]), *args[where + 1 :]), kwargs
    if where is not None:
        return args, {**kwargs, where: fn(kwargs[where])}
    return args, kwargs


def _gather_inputs_hook(mesh: DeviceMesh):
    """Branch input: the sequence-sharded stream becomes full length (backward: reduce-scatter)."""

    def gather(value: torch.Tensor) -> torch.Tensor:
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, mesh, [Shard(1)], run_check=False)
        return value.redistribute(mesh, [Replicate()]).to_local()

    def hook(module, args, kwargs):
        return _replace_stream(args, kwargs, gather)

    return hook


def _shard_sequence_hook(mesh: DeviceMesh):
    """First block: the replicated full-length stream becomes this rank's sequence shard."""

    def shard(value: torch.Tensor) -> torch.Tensor:
        full = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        return full.redistribute(mesh, [Shard(1)]).to_local()

    def hook(module, args, kwargs):
        return _replace_stream(args, kwargs, shard)

    return hook


class LocalRowsParallel(ParallelStyle):
    """A per-row module fed this rank's rows of a sharded stream: parameters replicated over the
    mesh, activations left as plain local tensors.  Its forward must read local views of the
    parameters, whose gradients are then partial sums over the ranks' rows."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param.detach(), device_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module._adapt_rows_mesh = device_mesh
        return module


def _attention_branch(parts: ModelParts) -> tuple[str, BranchParts] | None:
    for block in parts.blocks:
        for branch in block.branches:
            if branch.attention:
                return block.path, branch
    return None


def find_head_count_attributes(model: nn.Module, parts: ModelParts, tp: int) -> list[str]:
    """Which integer attributes of the attention module count heads, found by probing on one block.

    Modelling code that reshapes with ``-1`` heads needs nothing; code that reshapes with a stored
    head count needs it divided by ``tp``.  Values alone cannot tell a head count from, say, a GQA
    ratio that happens to be equal, so each candidate subset is tried on rank 0's shard of the
    weights and kept when the attention output fed to the fan-in projection equals rank 0's slice
    of the unsharded one.
    """
    found = _attention_branch(parts)
    if found is None or parts.heads is None or tp == 1:
        return []
    block_path, branch = found
    module = model.get_submodule(f"{block_path}.{branch.path}")
    heads = parts.heads
    candidates = [n for n, v in vars(module).items() if type(v) is int and v in (heads.num_heads, heads.num_kv_heads)]
    if not candidates:
        return []
    rel = len(branch.path) + 1
    fan_in = module.get_submodule(branch.rowwise[0][rel:])
    seen: dict[str, object] = {}

    def grab_call(mod, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    def grab_fan_in(mod, args):
        seen["fan_in"] = args[0]

    handles = [
        module.register_forward_pre_hook(grab_call, with_kwargs=True),
        fan_in.register_forward_pre_hook(grab_fan_in),
    ]
    probe = torch.randint(0, parts.vocab_size, (1, 8), device=next(model.parameters()).device)
    try:
        with torch.no_grad():
            model(input_ids=probe, use_cache=False)
        handles.pop(0).remove()
        return _probe_subsets(module, branch, candidates, seen, tp)
    finally:
        for handle in handles:
            handle.remove()


def _probe_subsets(module: nn.Module, branch: BranchParts, candidates: list[str], seen: dict, tp: int) -> list[str]:
    """Smallest subset of ``candidates`` that, divided by ``tp``, reproduces rank 0's heads on rank 0's weights."""
    # Fresh random weights and hidden states: the probe must not depend on the model's values.
    args, kwargs = _replace_stream(*seen["call"], torch.randn_like)
    full = {name: torch.randn_like(param) / param.shape[-1] ** 0.5 for name, param in module.named_parameters()}
    with torch.no_grad():
        torch.func.functional_call(module, full, args, kwargs)
    width = seen["fan_in"].shape[-1]
    expected = seen["fan_in"][..., : width // tp]
    shard = dict(full)
    for name, value in full.items():
        owner = f"{branch.path}.{name.rpartition('.')[0]}"
        if owner in branch.colwise:
            shard[name] = value[: value.shape[0] // tp]
        elif owner == branch.rowwise[0] and name.endswith("weight"):
            shard[name] = value[:, : value.shape[1] // tp]
    original = {n: getattr(module, n) for n in candidates}
    for size in range(len(candidates) + 1):
        for subset in itertools.combinations(candidates, size):
            for n in candidates:
                setattr(module, n, original[n] // tp if n in subset else original[n])
            seen.pop("fan_in", None)
            try:
                with torch.no_grad():
                    torch.func.functional_call(module, shard, args, kwargs)
            except RuntimeError:
                continue
            finally:
                for n, v in original.items():
                    setattr(module, n, v)
            got = seen.get("fan_in")
            if got is not None and got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
                return list(subset)
    raise BadInput("tensor parallelism: could not find how the attention module counts its heads (probe failed)")


def _localise_head_counts(model: nn.Module, parts: ModelParts, tp: int) -> None:
    for block in parts.blocks:
        for branch in block.branches:
            if branch.attention:
                module = model.get_submodule(f"{block.path}.{branch.path}")
                for name in parts.head_count_attrs:
                    setattr(module, name, getattr(module, name) // tp)


def check_tensor_parallel(parts: ModelParts, tp: int, vocab_parallel: bool) -> None:
    """Raise ``BadInput`` when the model cannot be split ``tp`` ways along head/width boundaries."""
    for block in parts.blocks:
        for branch in block.branches:
            if branch.experts:
                raise BadInput(
                    f"{block.path}.{branch.path}: tensor parallelism over MoE experts is not realised; use ep"
                )
            if branch.unplaced:
                raise BadInput(
                    f"tensor parallelism cannot place {block.path}.{branch.unplaced[0]} (not fed by the branch input)"
                )
            if len(branch.rowwise) != 1:
                raise BadInput(f"{block.path}.{branch.path}: no single fan-in projection found for tensor parallelism")
    heads = parts.heads
    if heads is None:
        raise BadInput("tensor parallelism needs the attention head geometry (num heads, kv heads, head dim)")
    if heads.num_heads % tp or heads.num_kv_heads % tp:
        raise BadInput(
            f"tp={tp} must divide both query heads ({heads.num_heads}) and kv heads ({heads.num_kv_heads}) for GQA-aware splitting"
        )
    if vocab_parallel and parts.vocab_size % tp:
        raise BadInput(f"vocab-parallel embedding needs tp={tp} to divide the vocabulary ({parts.vocab_size})")


def block_plan(
    parts: ModelParts,
    index: int,
    sequence_parallel: bool,
    local_rows: frozenset[str] = frozenset(),
) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of one block, keyed by paths relative to the block;
    ``local_rows`` (absolute paths) are row-wise modules that run on local tensors."""
    block = parts.blocks[index]

    def rows(name: str, sequence_dim: int = 1) -> ParallelStyle:
        if f"{block.path}.{name}" in local_rows:
            return LocalRowsParallel()
        return SequenceParallel(sequence_dim=sequence_dim, use_local_output=True)

    out_layout = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    for branch in block.branches:
        for name in branch.colwise:
            plan[name] = ColwiseParallel()
        plan[branch.rowwise[0]] = RowwiseParallel(output_layouts=out_layout)
        for name in branch.head_norms:
            # Per-head norm weights are replicated; their inputs are head-sharded on dim -2.
            plan[name] = rows(name, sequence_dim=-2)
    if sequence_parallel:
        for name in block.norms:
            plan[name] = rows(name)
    return plan


def apply_tensor_parallel(
    model: nn.Module,
    parts: ModelParts,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    vocab_parallel: bool,
    local_rows: frozenset[str] = frozenset(),
) -> None:
    """Shard ``model`` in place over ``tp_mesh`` (the same on every tp rank)."""
    check_tensor_parallel(parts, tp_mesh.size(), vocab_parallel)
    _localise_head_counts(model, parts, tp_mesh.size())
    for index, block in enumerate(parts.blocks):
        module = model.get_submodule(block.path)
        parallelize_module(module, tp_mesh, block_plan(parts, index, sequence_parallel, local_rows))
        if sequence_parallel:
            for branch in block.branches:
                module.get_submodule(branch.path).register_forward_pre_hook(
                    _gather_inputs_hook(tp_mesh), with_kwargs=True
                )
    if sequence_parallel:
        if parts.embedding:  # where the stream enters; later pipeline stages receive it already sharded
            first = model.get_submodule(parts.blocks[0].path)
            first.register_forward_pre_hook(_shard_sequence_hook(tp_mesh), with_kwargs=True)
        if parts.final_norm:
            parallelize_module(
                model.get_submodule(parts.final_norm),
                tp_mesh,
                LocalRowsParallel() if parts.final_norm in local_rows else SequenceParallel(use_local_output=True),
            )
    if vocab_parallel and parts.embedding:  # a later pipeline stage holds no embedding
        # Row-sharded table: each rank looks up its vocabulary range, partial sums are all-reduced.
        parallelize_module(
            model.get_submodule(parts.embedding),
            tp_mesh,
            RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        )
    if parts.head is None:
        return
    head = model.get_submodule(parts.head)
    if vocab_parallel:
        in_layout = Shard(1) if sequence_parallel else Replicate()
        parallelize_module(
            head,
            tp_mesh,
            ColwiseParallel(input_layouts=in_layout, output_layouts=Replicate()),
        )
        if parts.tied:  # one parameter, two users: keep a single DTensor shared by both
            head.weight = model.get_submodule(parts.embedding).weight
    elif sequence_parallel:
        head.register_forward_pre_hook(_gather_inputs_hook(tp_mesh), with_kwargs=True)
