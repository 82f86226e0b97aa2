"""One numeric probe per distinct structure: modules that are numerically interchangeable share a verdict.

A 16-layer model has 16 identical attention modules, 16 identical MLPs and 33 norms of two or three
kinds; probing each one costs a float64 copy and a forward+backward per layer (tens of seconds at
1B width) and tells nothing the first probe did not.  Two modules are interchangeable when the key
below is equal: the same class object, parameter and buffer names/shapes/dtypes (small buffers by
content), the same plain float/bool/str attributes (eps, flags), and the same traced op sequence of
every module in the subtree, ATen overloads with their shapes and non-tensor arguments.  Integer
attributes are left out of the key on purpose (``layer_idx`` differs in every layer): an integer
that changes the computation must reach an ATen op as a shape, a size or a scalar argument, which
the traced sequences already hold.  For probes that replay the module's captured call (attention),
every captured input except the hidden states the probe redraws is part of the key too, so a layer
fed a sliding-window mask is never answered by a layer fed a causal one.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from operators.inventory import ModuleRecord, OpInventory

_PLAIN_ATTRIBUTES = (bool, float, str, type(None))
_BUFFER_DIGEST_LIMIT = 1 << 22  # elements; larger buffers are keyed by shape and dtype only


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def _tensor_key(tensor: torch.Tensor, with_content: bool) -> tuple:
    content = (
        _digest(tensor)
        if with_content and tensor.device.type != "meta" and tensor.numel() <= _BUFFER_DIGEST_LIMIT
        else None
    )
    return (tuple(tensor.shape), str(tensor.dtype), content)


def structure_key(module: nn.Module, rec: ModuleRecord, inv: OpInventory, *, call_inputs: bool = False) -> tuple:
    """The interchangeability key of ``module`` (traced as ``rec`` in ``inv``); see the module docstring."""
    attributes = tuple(
        sorted((f"{name}.{k}", repr(v)) for name, m in module.named_modules() for k, v in vars(m).items()
               if not k.startswith("_") and isinstance(v, _PLAIN_ATTRIBUTES))
    )  # fmt: skip
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters())
    buffers = tuple((n, _tensor_key(b, True)) for n, b in module.named_buffers())
    prefix = rec.path + "."
    subtree = sorted(r for r in inv.modules if r == rec.path or r.startswith(prefix))
    sequences = tuple(
        (path[len(rec.path) :], json.dumps(inv.modules[path].sequence), tuple(sorted(inv.modules[path].ops.items())))
        for path in subtree
    )
    key = (
        type(module),
        params,
        buffers,
        attributes,
        sequences,
        tuple(rec.scalars),
        tuple(map(tuple, rec.input_shapes)),
    )
    if call_inputs:
        key += (_call_key(inv.captured.get(rec.path)),)
    return key


def _call_key(call: tuple[tuple, dict] | None) -> tuple:
    """Everything of a captured call but its first tensor (the hidden states, which probes redraw)."""
    if call is None:
        return ()
    flat, spec = tree_flatten(call)
    first = next((i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)), None)
    parts = []
    for i, value in enumerate(flat):
        if isinstance(value, torch.Tensor):
            parts.append(
                _tensor_key(value, i != first) if i != first else ("hidden", tuple(value.shape), str(value.dtype))
            )
        elif value is None or isinstance(value, (bool, int, float, str)):
            parts.append(repr(value))
        else:
            parts.append(type(value).__qualname__)  # stateful helpers (caches): probes run without them
    return (str(spec), tuple(parts))


class ProbeCache:
    """Verdicts of numeric probes by structure key, with the module each was measured on."""

    def __init__(self) -> None:
        self.verdicts: dict[tuple, tuple[str, Any]] = {}
        self.probes_run = 0

    def verdict(self, key: tuple, path: str, probe: Callable[[], Any]) -> tuple[Any, str]:
        """The probe's verdict for ``path`` (run only for a new key) and an evidence suffix naming
        the module it was measured on, empty when that is ``path`` itself."""
        if key not in self.verdicts:
            self.probes_run += 1
            self.verdicts[key] = (path, probe())
        first, found = self.verdicts[key]
        if first == path:
            return copy.deepcopy(found), ""
        suffix = f" (probed on {first}: same class, parameters, attributes and traced ops)"
        return _rebased(found, first, path), suffix


def _rebased(value: Any, first: str, path: str) -> Any:
    """A copy of ``value`` with the module paths it names under ``first`` moved to ``path`` (an MoE's router
    and expert banks belong to the module asking, not to the one the probe ran on)."""
    if isinstance(value, str) and (value == first or value.startswith(first + ".")):
        return path + value[len(first) :]
    if isinstance(value, dict):
        return {k: _rebased(v, first, path) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_rebased(v, first, path) for v in value)
    return copy.deepcopy(value)
