"""One numeric probe per distinct structure: modules that are numerically interchangeable share a verdict.

A 16-layer model has 16 identical attention modules, 16 identical MLPs and 33 norms of two or three
kinds; probing each one costs a float64 copy and a forward+backward per layer (tens of seconds at
1B width) and tells nothing the first probe did not.  Two modules are interchangeable when the key
below is equal: the same class objects (the module's and every submodule's), parameter and buffer names/shapes/dtypes (small buffers by
content), the same plain float/bool/str attributes (eps, flags), and the same traced op sequence of
every module in the subtree, ATen overloads with their shapes and non-tensor arguments.  Integer
attributes are left out of the key on purpose (``layer_idx`` differs in every layer): an integer
that changes the computation must reach an ATen op as a shape, a size or a scalar argument, which
the traced sequences already hold.  For probes that replay the module's captured call (attention),
every captured input except the hidden states the probe redraws is part of the key too, so a layer
fed a sliding-window mask is never answered by a layer fed a causal one.

Verdicts also keep across runs when the cache is given a ``DiskCache``: a verdict depends on code, never
on weights (probes redraw every parameter), so the on-disk key replaces each class object by its code
identity (module, qualified name, and a digest of its file with the ``.py`` files beside it) and adds a
digest of adapt's own probe code plus the library versions.  A class whose source cannot be read from a
file (defined inside a function, or in ``__main__``) has no code identity; its verdicts stay in memory.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from operators.inventory import ModuleRecord, OpInventory
from operators.timing_cache import DiskCache, adapt_code_digest, make_key

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
        tuple(type(m) for m in module.modules()),  # the module's class first, then every class below it
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


@dataclass(frozen=True)
class Answer:
    """One verdict handed to a module: where its probe ran, and whether that was in an earlier run."""

    module: str
    probed_on: str
    earlier_run: bool


class ProbeCache:
    """Verdicts of numeric probes by structure key, with the module each was measured on.

    With ``store``, verdicts are also read from and written to disk under the key's code identity, so a
    second run of the same model (or another model built from the same classes) probes nothing again."""

    def __init__(self, store: DiskCache | None = None) -> None:
        self.verdicts: dict[tuple, tuple[str, Any]] = {}
        self.probes_run = 0
        self.reused_from_disk = 0
        self._store = store
        self._from_disk: set[tuple] = set()
        self.answers: list[Answer] = []  # every verdict handed out, in order

    def verdict(self, key: tuple, path: str, probe: Callable[[], Any]) -> tuple[Any, str]:
        """The probe's verdict for ``path`` (run only for a new key) and an evidence suffix naming
        the module it was measured on, empty when that is ``path`` itself."""
        if key not in self.verdicts:
            disk_key = self._disk_key(key)
            stored = self._store.get(disk_key) if self._store is not None and disk_key else None
            if isinstance(stored, dict) and {"path", "verdict"} <= stored.keys():
                self.verdicts[key] = (stored["path"], _decode(stored["verdict"]))
                self._from_disk.add(key)
                self.reused_from_disk += 1
            else:
                self.probes_run += 1
                self.verdicts[key] = (path, probe())
                if disk_key:
                    self._save(disk_key, *self.verdicts[key])
        first, found = self.verdicts[key]
        self.answers.append(Answer(path, first, key in self._from_disk))
        if key in self._from_disk:
            suffix = f" (probed on {first} in an earlier run: same class code, parameters, attributes and traced ops)"
            return _rebased(found, first, path), suffix
        if first == path:
            return copy.deepcopy(found), ""
        suffix = f" (probed on {first}: same class, parameters, attributes and traced ops)"
        return _rebased(found, first, path), suffix

    def _disk_key(self, key: tuple) -> str | None:
        if self._store is None:
            return None
        try:
            portable = _portable(key)
        except _NoCodeIdentity:
            return None
        return make_key("cpu", "probe verdict", adapt_code_digest(), portable)

    def _save(self, disk_key: str, path: str, verdict: Any) -> None:
        try:
            encoded = _encode(verdict)
            json.dumps(encoded)
        except (TypeError, ValueError):
            return  # a verdict that JSON cannot hold stays in memory
        assert self._store is not None
        self._store.put(disk_key, {"path": path, "verdict": encoded})


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


class _NoCodeIdentity(Exception):
    """A class in the key whose code cannot be pinned to files on disk."""


def _directory_digest(directory: Path) -> str:
    """The ``.py`` files beside a class's own (remote code imports its helpers from there); read again only
    when a file's size or modification time changed, so an edit in a long-lived process is seen."""
    files = sorted(directory.glob("*.py"))  # not recursive: a module at a package root stays cheap
    return _digest_files(tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files))


@functools.cache
def _digest_files(stamps: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for file, _, _ in stamps:
        h.update(Path(file).name.encode())
        h.update(Path(file).read_bytes())
    return h.hexdigest()[:16]


def _code_identity(cls: type) -> tuple[str, str, str]:
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
        raise _NoCodeIdentity(cls.__qualname__)
    try:
        file = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        file = None
    if not file or not Path(file).is_file():
        raise _NoCodeIdentity(cls.__qualname__)
    return (cls.__module__, cls.__qualname__, _directory_digest(Path(file).resolve().parent))


def _portable(value: Any) -> Any:
    """``value`` with every class replaced by its code identity; raises ``_NoCodeIdentity``."""
    if isinstance(value, type):
        return ["class", *_code_identity(value)]
    if isinstance(value, (tuple, list)):
        return [_portable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _portable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise _NoCodeIdentity(type(value).__qualname__)


def _encode(value: Any) -> Any:
    """JSON form of a verdict that keeps tuples apart from lists."""
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("verdict dict with non-string keys")
        return {k: _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(type(value).__qualname__)


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v) for v in value["__tuple__"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value
