"""Checkpoints with ``torch.distributed.checkpoint``: layout-independent save/load, HF safetensors export.

DCP stores every tensor under its HF parameter name with its *global* shape, so a checkpoint
written by one layout (FSDP on 2 ranks) loads into another (TP on 2 ranks) and DCP reshards on
read.  FSDP/TP parameters are already DTensors.  Expert-parallel weights are plain local shards
(see ``expert_parallel``): they are presented to DCP as ``DTensor`` views sharded on the expert
dim over the ``ep`` mesh, sharing storage, so loads land in place.  Optimizer state is saved
flattened (``state.<param>.<key>``) so that several pipeline chunks' optimizers merge cleanly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from adapt.core.errors import BadInput
from adapt.runtime.parallelize import ParallelModel

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _expert_storages(pmodel: ParallelModel) -> set[int]:
    return {p.data_ptr() for p in (pmodel.experts.params if pmodel.experts else [])}


def _expert_names(pmodel: ParallelModel) -> set[str]:
    if pmodel.experts is None:
        return set()
    return {f"{shard.path}.{name}" for shard in pmodel.experts.shards for name in shard.param_names}


def _param_of(key: str) -> str:
    """``<fqn>`` (model) or ``state.<fqn>.<name>`` / ``param_groups.<fqn>.<name>`` (optimizer) -> ``<fqn>``."""
    if key.startswith(("state.", "param_groups.")):
        return key.split(".", 1)[1].rsplit(".", 1)[0]
    return key


def _wrap_experts(state: dict[str, Any], pmodel: ParallelModel) -> tuple[dict[str, Any], set[str]]:
    """Present local expert shards (weights and optimizer moments) as global DTensors sharing storage."""
    names = _expert_names(pmodel)
    wrapped, keys = {}, set()
    for key, value in state.items():
        if _param_of(key) in names and isinstance(value, torch.Tensor) and value.ndim > 0:
            value = DTensor.from_local(value, pmodel.experts.ep_mesh, [Shard(0)], run_check=False)
            keys.add(key)
        wrapped[key] = value
    return wrapped, keys


def _chunk_states(pmodel: ParallelModel, optimizers: list[torch.optim.Optimizer]) -> tuple[dict, dict, set[str]]:
    model_state: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    for chunk, optimizer in zip(pmodel.chunks, optimizers):
        model_state.update(get_model_state_dict(chunk, options=_OPTIONS))
        optim_state.update(get_optimizer_state_dict(chunk, optimizer, options=_OPTIONS))
    model_state, model_keys = _wrap_experts(model_state, pmodel)
    optim_state, optim_keys = _wrap_experts(optim_state, pmodel)
    return model_state, optim_state, model_keys | optim_keys


def save(
    directory: str | Path,
    pmodel: ParallelModel,
    optimizers: list[torch.optim.Optimizer],
    step: int,
) -> None:
    """Write model + optimizer state and the step counter with DCP (every rank calls this)."""
    model_state, optim_state, _ = _chunk_states(pmodel, optimizers)
    dcp.save(
        {"model": model_state, "optim": optim_state, "step": torch.tensor(step)},
        checkpoint_id=str(directory),
    )


def load(
    directory: str | Path,
    pmodel: ParallelModel,
    optimizers: list[torch.optim.Optimizer],
) -> int:
    """Load a DCP checkpoint written under any layout into this one; returns the saved step."""
    if not (Path(directory) / ".metadata").is_file():
        raise BadInput(f"{directory}: not a torch.distributed.checkpoint directory (no .metadata)")
    model_state, optim_state, expert_keys = _chunk_states(pmodel, optimizers)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(directory))

    def local(values: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to_local() if k in expert_keys else v for k, v in values.items()}

    model_values, optim_values = local(state["model"]), local(state["optim"])
    for chunk, optimizer in zip(pmodel.chunks, optimizers):
        mine = set(get_model_state_dict(chunk, options=_OPTIONS))
        set_model_state_dict(
            chunk,
            {k: v for k, v in model_values.items() if k in mine},
            options=_OPTIONS,
        )
        chunk_optim = {k: v for k, v in optim_values.items() if _param_of(k) in mine}
        set_optimizer_state_dict(chunk, optimizer, chunk_optim, options=_OPTIONS)
    return int(state["step"])


def gather_full_state_dict(pmodel: ParallelModel) -> dict[str, torch.Tensor] | None:
    """Whole, unsharded model weights on global rank 0 (``None`` elsewhere); every rank calls this."""
    storages = _expert_storages(pmodel)
    mine: dict[str, torch.Tensor] = {}
    for chunk in pmodel.chunks:
        for key, value in get_model_state_dict(chunk, options=_OPTIONS).items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            elif value.data_ptr() in storages:
                parts = [torch.empty_like(value) for _ in range(pmodel.experts.ep_mesh.size())]
                dist.all_gather(parts, value.contiguous(), group=pmodel.experts.ep_mesh.get_group())
                value = torch.cat(parts)
            mine[key] = value.detach().cpu()
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        full.update(part)
    return full


def export_hf(directory: str | Path, pmodel: ParallelModel, config: Any) -> Path | None:
    """Write a plain HF checkpoint (config.json + model.safetensors) from rank 0; every rank calls this."""
    from safetensors.torch import save_file

    full = gather_full_state_dict(pmodel)
    if full is None:
        return None
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if pmodel.parts.tied and pmodel.parts.head:
        full.pop(f"{pmodel.parts.head}.weight", None)  # HF re-ties it from the embedding on load
    save_file(
        {k: v.contiguous() for k, v in full.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.save_pretrained(out)
    (out / "adapt_export.json").write_text(
        json.dumps({"tensors": len(full), "plan": pmodel.dims.plan.to_dict()}, indent=2)
    )
    return out
