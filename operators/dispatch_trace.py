"""The op tracer behind the inventory: every ATen op a call dispatches, attributed to the module that ran it.

Tracing runs the model under a ``TorchDispatchMode`` - the same interception point AOTAutograd's
``make_fx`` uses to build joint graphs - so it records ops *after* autograd and
CompositeImplicit decomposition, forward and backward, on real, fake or meta tensors alike.
Module ownership comes from forward hooks; backward ops are attributed through metadata that
the forward hooks stamp on the autograd nodes each module created.  Meta-tensor tracing needs no
weights, which is how config-only giants are inventoried one distinct block at a time.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

ROOT = ""  # module path of the model itself
# One meta-tensor example call per overload seen by any trace: what decomposition checks re-trace.
_EXAMPLE_CALLS: dict[str, tuple[Any, tuple, dict]] = {}


def example_call(overload: str) -> tuple[Any, tuple, dict] | None:
    return _EXAMPLE_CALLS.get(overload)


_META_KEY = "adapt_module"


@dataclass
class OpRecord:
    """One ATen overload as used by one module in one phase."""

    overload: str  # e.g. "aten.mm.default"
    module: str
    phase: str  # "forward" | "backward"
    count: int
    core: bool  # member of the core ATen opset (torch.Tag.core)
    input_shapes: list[list[int]]
    dtypes: list[str]
    flops: int = 0  # matmul-class FLOPs over all calls (2*M*N*K), 0 for everything else


@dataclass
class ModuleRecord:
    """What one module looked like during the trace: its own ops, scalars, shapes and parameters."""

    path: str
    class_name: str  # display only; never used to decide anything
    children: list[str]
    params: dict[str, list[int]]  # directly owned parameters: local name -> shape
    input_shapes: list[list[int]]
    output_shapes: list[list[int]]
    ops: dict[str, int]  # forward ops of the whole subtree: overload -> count
    own_ops: dict[str, int]  # forward ops attributed to this module itself
    scalars: list[float]  # float constants the subtree passed to ops (eps, softcap, offsets...)
    calls: int = 0
    # The module's own forward ops of its first call, in order: [overload, input shapes, non-tensor args].
    sequence: list[list[Any]] = field(default_factory=list)
    fed_by_add: str | None = None  # module whose ``aten.add`` produced this module's first input
    # Where that add ran in the adding module's own code: after which of its direct children returned
    # (None: before any), and how many adds that module had run since.  Hooks on the children find it again.
    fed_by_add_after: str | None = None
    fed_by_add_index: int | None = None


def _shape_of(value: Any) -> list[int] | None:
    if isinstance(value, torch.Tensor):
        return [int(s) for s in value.shape]
    return None


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _matmul_flops(name: str, args: tuple, out: Any) -> int:
    """2*M*N*K for the matmul family; attention-core ops count QK^T and PV."""
    shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
    if name in ("aten.mm.default", "aten.bmm.default") and len(shapes) >= 2:
        a, b = shapes[0], shapes[1]
        batch = a[0] if len(a) == 3 else 1
        return 2 * batch * a[-2] * a[-1] * b[-1]
    if name == "aten.addmm.default" and len(shapes) >= 3:
        a, b = shapes[1], shapes[2]
        return 2 * a[0] * a[1] * b[1]
    if "scaled_dot_product" in name and "backward" not in name and len(shapes) >= 3:
        q, k, v = shapes[:3]
        lead = 1
        for s in q[:-2]:
            lead *= s
        return 2 * lead * q[-2] * k[-2] * (q[-1] + v[-1])
    if name == "aten._grouped_mm.default" and len(shapes) >= 2:
        a, b = shapes[0], shapes[1]
        return 2 * a[0] * a[-1] * b[-1]
    return 0


class _Recorder(TorchDispatchMode):
    """Counts every dispatched ATen op under the module that owns it."""

    def __init__(
        self,
        current_module: Callable[[], str],
        first_call: Callable[[str], bool],
        add_position: Callable[[str], tuple[str | None, int]],
    ):
        super().__init__()
        self.current_module = current_module
        self.first_call = first_call
        self.add_position = add_position
        self.phase = "forward"
        self.records: dict[tuple[str, str, str], OpRecord] = {}
        self.scalars: dict[str, list[float]] = {}
        self.sequences: dict[str, list[list[Any]]] = {}
        # id(tensor) -> (tensor ref, module, (child it ran after, adds since that child))
        self.add_outputs: dict[int, tuple[weakref.ref, str, tuple[str | None, int]]] = {}
        self.example_calls: dict[str, tuple[Any, tuple, dict]] = {}  # overload -> (op, meta args, kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            module = node.metadata.get(_META_KEY, "<backward>") if node is not None else "<backward>"
        else:
            module = self.current_module()
        name = str(func)
        if not name.startswith("aten."):
            name = f"{func.namespace}.{func._opname}.{func._overloadname}"
        key = (name, module, self.phase)
        flat = tree_flatten((args, kwargs))[0]
        rec = self.records.get(key)
        if rec is None:
            rec = OpRecord(
                overload=name,
                module=module,
                phase=self.phase,
                count=0,
                core=torch.Tag.core in getattr(func, "tags", ()),
                input_shapes=[s for s in (_shape_of(a) for a in flat) if s is not None],
                dtypes=sorted({str(a.dtype).replace("torch.", "") for a in flat if isinstance(a, torch.Tensor)}),
            )
            self.records[key] = rec
        if name not in self.example_calls:
            self.example_calls[name] = (func, *tree_map(_to_meta, (tuple(args), dict(kwargs))))
        rec.count += 1
        rec.flops += _matmul_flops(name, tuple(a for a in flat if isinstance(a, torch.Tensor)), out)
        if self.phase == "forward":
            floats = [float(a) for a in flat if isinstance(a, float)]
            if floats:
                self.scalars.setdefault(module, []).extend(floats)
            if self.first_call(module):
                self.sequences.setdefault(module, []).append([name, rec_shapes(flat), _plain_args(flat)])
            if name == "aten.add.Tensor" and isinstance(out, torch.Tensor):
                self.add_outputs[id(out)] = (weakref.ref(out), module, self.add_position(module))
        return out

    def producer_add(self, tensor: torch.Tensor) -> tuple[str, str | None, int] | None:
        """(module, child it ran after, adds since) of the ``aten.add.Tensor`` that produced exactly this tensor."""
        entry = self.add_outputs.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1], *entry[2]
        return None


def rec_shapes(flat: list[Any]) -> list[list[int]]:
    return [s for s in (_shape_of(a) for a in flat) if s is not None]


def _plain_args(flat: list[Any]) -> list[Any]:
    """Non-tensor arguments that are JSON-friendly (sizes, dims, scalars, flags)."""
    out = []
    for a in flat:
        if isinstance(a, (bool, int, float)) and not isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, torch.dtype):
            out.append(str(a).replace("torch.", ""))
    return out


def _tag_graph(tensors: Iterable[torch.Tensor], path: str) -> None:
    """Stamp ``path`` on every not-yet-owned autograd node reachable from ``tensors``."""
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or _META_KEY in node.metadata:
            continue
        node.metadata[_META_KEY] = path
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


class _ModuleTracker:
    """Forward hooks that maintain the current module path and collect per-module shapes."""

    def __init__(self, model: nn.Module, track_backward: bool, capture: bool):
        self.stack: list[str] = [ROOT]
        self.track_backward = track_backward
        self.capture = capture
        self.captured: dict[str, tuple[tuple, dict]] = {}  # first-call inputs, detached
        self.fed_by_add: dict[str, tuple[str, str | None, int]] = {}
        self.after_child: dict[str, list] = {}  # module -> [direct child that returned last or None, adds since]
        self.recorder: _Recorder | None = None
        self.shapes: dict[str, tuple[list[list[int]], list[list[int]]]] = {}
        self.calls: Counter = Counter()
        self.handles = []
        for path, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._pre(path), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(path), with_kwargs=True, always_call=True))

    def current(self) -> str:
        return self.stack[-1]

    def first_call(self, path: str) -> bool:
        return self.calls[path] <= 1

    def _pre(self, path: str):
        def hook(module, args, kwargs):
            if self.track_backward:  # ops run by the caller before this call belong to the caller
                _tag_graph(_tensors((args, kwargs)), self.stack[-1])
            self.stack.append(path)
            self.after_child[path] = [None, 0]
            self.calls[path] += 1
            if path not in self.shapes:
                inputs = _tensors((args, kwargs))
                self.shapes[path] = ([s for s in map(_shape_of, inputs) if s], [])
                if self.recorder is not None and inputs:
                    producer = self.recorder.producer_add(inputs[0])
                    if producer is not None:
                        self.fed_by_add[path] = producer
                if self.capture:
                    self.captured[path] = tree_map(_detach, (tuple(args), dict(kwargs)))

        return hook

    def _post(self, path: str):
        def hook(module, args, kwargs, output):
            if self.track_backward:
                _tag_graph(_tensors(output), path)
            if self.stack and self.stack[-1] == path:
                self.stack.pop()
                if self.stack:
                    self.after_child[self.stack[-1]] = [path, 0]
            ins, outs = self.shapes[path]
            if not outs:
                self.shapes[path] = (ins, [s for s in map(_shape_of, _tensors(output)) if s])

        return hook

    def add_position(self, module: str) -> tuple[str | None, int]:
        """For an add ``module`` runs now: the direct child it follows, and how many adds came since."""
        entry = self.after_child.setdefault(module, [None, 0])
        entry[1] += 1
        return entry[0], entry[1] - 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def trace_ops(
    model: nn.Module,
    run: Callable[[nn.Module], Any],
    *,
    backward: bool = False,
    capture: bool = False,
    prefix: str = "",
) -> tuple[dict[tuple[str, str, str], OpRecord], dict[str, ModuleRecord], dict[str, tuple[tuple, dict]]]:
    """Run ``run(model)`` (and ``.backward()`` on its scalar result when ``backward``) under the recorder.

    Returns the op records, one ``ModuleRecord`` per called module and, with ``capture``, each
    module's first-call inputs (detached) so probes can re-run it with fresh data.
    """
    tracker = _ModuleTracker(model, track_backward=backward, capture=capture)
    recorder = _Recorder(tracker.current, tracker.first_call, tracker.add_position)
    tracker.recorder = recorder
    try:
        with recorder:
            result = run(model)
            if backward:
                if backward and isinstance(result, torch.Tensor) and result.grad_fn is not None:
                    _tag_graph([result], ROOT)
                recorder.phase = "backward"
                result.backward()
    finally:
        tracker.remove()
    records: dict[tuple[str, str, str], OpRecord] = {}
    for (name, module, phase), rec in recorder.records.items():
        rec.module = _join(prefix, module) if not module.startswith("<") else module
        records[(name, rec.module, phase)] = rec
    modules = _module_records(model, recorder, tracker, prefix)
    captured = {_join(prefix, k): v for k, v in tracker.captured.items()}
    _EXAMPLE_CALLS.update({k: v for k, v in recorder.example_calls.items() if k not in _EXAMPLE_CALLS})
    return records, modules, captured


def _join(prefix: str, path: str) -> str:
    return ".".join(p for p in (prefix, path) if p)


def _module_records(
    model: nn.Module, recorder: _Recorder, tracker: _ModuleTracker, prefix: str
) -> dict[str, ModuleRecord]:
    own: dict[str, Counter] = {}
    for rec in recorder.records.values():
        if rec.phase == "forward":
            own.setdefault(rec.module, Counter())[rec.overload] += rec.count
    out: dict[str, ModuleRecord] = {}
    for path, module in model.named_modules():
        if path not in tracker.shapes:
            continue  # never called
        full = _join(prefix, path)
        sub_ops: Counter = Counter()
        scalars: list[float] = []
        for mod_path, counts in own.items():
            if mod_path == full or full == "" or mod_path.startswith(full + "."):
                sub_ops.update(counts)
        for mod_path, values in recorder.scalars.items():
            if mod_path == full or full == "" or mod_path.startswith(full + "."):
                scalars.extend(values)
        ins, outs = tracker.shapes[path]
        out[full] = ModuleRecord(
            path=full,
            class_name=type(module).__name__,
            children=[_join(full, n) for n, _ in module.named_children()],
            params={n: list(p.shape) for n, p in module.named_parameters(recurse=False)},
            input_shapes=ins,
            output_shapes=outs,
            ops=dict(sub_ops),
            own_ops=dict(own.get(full, {})),
            scalars=sorted(set(scalars)),
            calls=tracker.calls[path],
            sequence=recorder.sequences.get(full, []),
            **_fed_by_add(prefix, tracker.fed_by_add.get(path)),
        )
    return out


def _fed_by_add(prefix: str, producer: tuple[str, str | None, int] | None) -> dict[str, Any]:
    if producer is None:
        return {}
    module, after, index = producer
    return {
        "fed_by_add": _join(prefix, module),
        "fed_by_add_after": _join(prefix, after) if after is not None else None,
        "fed_by_add_index": index,
    }
