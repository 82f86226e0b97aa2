"""Single modules' weights straight from safetensors shards, converted exactly as ``from_pretrained`` converts them.

transformers 5 loads many checkpoints through a weight-conversion mapping: per-expert linears stored
one per expert are stacked into 3-D banks, keys are renamed, fused projections split.  A streamed
loader that matched on-disk names to module names would miss all of these, so this one asks
transformers for the model's own mapping (``conversion_mapping.get_model_conversion_mapping``, what
``from_pretrained`` uses), renames every on-disk key with ``core_model_loading.rename_source_key``, and
runs the mapping's own ``convert`` operations on the tensors of one target at a time.  Only the
targets under one block are ever read, so the memory bound of streamed alignment holds for converted
checkpoints too.  Every tensor read is checked for NaN/Inf and a bad one is named by its on-disk key.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from safetensors import safe_open
from torch import nn

from adapt.core.errors import BadInput


class CorruptWeights(RuntimeError):
    """A tensor in the shards holds NaN/Inf: which model module it feeds, and its on-disk key."""

    def __init__(self, module_path: str, key: str):
        super().__init__(f"checkpoint tensor {key} (loaded into {module_path}) holds NaN/Inf")
        self.module_path, self.key = module_path, key


def all_finite(tensor: torch.Tensor) -> bool:
    """Exact NaN/Inf test at the cost of one reduction (a finite sum means finite terms)."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _conversions(model: nn.Module) -> list:
    """transformers' weight transforms for ``model``: renamings first-class, converters with their ops."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping

    return get_model_conversion_mapping(model) if isinstance(model, PreTrainedModel) else []


class ShardReader:
    """Maps each model tensor to the on-disk tensors it is built from and builds it on demand.

    ``targets`` holds, for every model state name a checkpoint group produces, the on-disk keys (in
    transformers' own natural order, which fixes the expert order of stacked banks) and the source
    pattern of the converter that claims them (``None``: a plain, possibly renamed, copy).
    """

    def __init__(self, src, model: nn.Module):
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        if src.weight_format != "safetensors" or not src.weight_files:
            raise BadInput(f"{src.text}: streamed loading needs safetensors weights")
        self.model = model
        self.file_of: dict[str, str] = {}
        for path in src.weight_files:
            with safe_open(path, framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    self.file_of[key] = path
        transforms = _conversions(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
        self._renaming = WeightRenaming
        meta_state = model.state_dict()
        prefix = getattr(model, "base_model_prefix", "") or None
        self.targets: dict[str, list[tuple[str, str | None]]] = {}
        for key in sorted(self.file_of, key=dot_natural_key):  # the order from_pretrained collects them in
            target, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
            if target not in meta_state and key in meta_state:
                target, pattern = rename_source_key(key, [], [], prefix, meta_state)
            if target in meta_state:
                self.targets.setdefault(target, []).append((key, pattern))
        self.converted = sorted(
            t for t, entries in self.targets.items() if len(entries) > 1 or entries[0][1] is not None
        )

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """On-disk tensors by key.  Each shard is opened only while it is read: a shard kept mapped
        would leave every page it ever touched resident, and the peak RSS is the point of streaming."""
        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.file_of[key], []).append(key)
        out = {}
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as fh:
                for key in names:
                    out[key] = fh.get_tensor(key)
        return out

    def load(self, targets: Iterable[str]) -> dict[str, torch.Tensor]:
        """Model-layout tensors (every name the conversion of each target produces), NaN/Inf refused."""
        out: dict[str, torch.Tensor] = {}
        for target in targets:
            entries = self.targets[target]
            raw = self.read(key for key, _ in entries)
            for key, tensor in raw.items():
                if not all_finite(tensor):
                    raise CorruptWeights(target.rpartition(".")[0], key)
            pattern = entries[0][1]
            mapping = copy.deepcopy(self._converter_of[pattern]) if pattern else self._renaming(entries[0][0], target)
            for key, source_pattern in entries:
                mapping.add_tensor(target, key, source_pattern or key, raw[key])
            try:
                converted = mapping.convert(target, model=self.model, config=getattr(self.model, "config", None))
            except Exception as err:
                raise BadInput(f"converting {[k for k, _ in entries][:3]} into {target} failed: {err}") from None
            for name, value in converted.items():
                out[name] = value[0] if isinstance(value, list) else value
        return out
