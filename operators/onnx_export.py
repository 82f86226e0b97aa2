"""ONNX view of a model: export with the dynamo exporter, run ``onnx.checker``, list op types and opset.

ONNX is the lingua franca of non-CUDA accelerators, so the backend profiles describe support in
both ATen overloads and ONNX op types; this module produces the ONNX side of the inventory.

What is checked and saved is the op graph with the weights as graph inputs: which ops the model needs
does not depend on its weights, and serialising them (a 128k-vocabulary embedding alone is 1 GiB in
float32) cost most of the export's time.  ``model.onnx`` is that graph, not a deployable model.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from adapt.model.calls import without_cache
from operators.inventory import OnnxReport


class _LogitsOnly(nn.Module):
    """Export wrapper: token ids in, the model's first output tensor out (no cache, no dict outputs)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, **without_cache(self.model))
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, (tuple, list)):
            return out[0]
        return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def export_onnx(model: nn.Module, input_ids: torch.Tensor, out_path: str | Path | None = None) -> OnnxReport:
    """Export ``model`` at the shape of ``input_ids``; never raises on exporter failure (the report says why)."""

    start = time.perf_counter()
    wrapper = _LogitsOnly(model).eval()
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            logging.getLogger("torch.onnx").setLevel(logging.ERROR)
            program = torch.onnx.export(wrapper, (input_ids,), dynamo=True, verbose=False)
        graph = program.model.graph
        weights = list(graph.initializers.values())
        graph.initializers.clear()
        graph.inputs.extend(weights)
        proto = program.model_proto
    except Exception as err:  # the exporter's failure is a finding, not a crash
        root = err
        while root.__cause__ is not None:
            root = root.__cause__
        return OnnxReport(
            exported=False, error=f"{type(root).__name__}: {(str(root).strip().splitlines() or [''])[0][:300]}"
        )
    opset = next((imp.version for imp in proto.opset_import if imp.domain in ("", "ai.onnx")), None)
    op_types: Counter = Counter()
    _count_nodes(proto.graph, op_types)
    for function in proto.functions:
        for node in function.node:
            op_types[_qualified(node)] += 1
    verdict, data = _check(proto)
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_bytes(data)
    report = OnnxReport(exported=True, opset=opset, checker=verdict, op_types=dict(sorted(op_types.items())))
    report.seconds = round(time.perf_counter() - start, 3)  # type: ignore[attr-defined]
    return report


def _check(proto) -> tuple[str, bytes]:
    """``onnx.checker``'s verdict and the serialised graph (serialised once, for the checker and the file)."""
    import onnx

    data = proto.SerializeToString()
    try:
        onnx.checker.check_model(data, full_check=False)
    except onnx.checker.ValidationError as err:
        return str(err).splitlines()[0][:300], data
    return "ok", data


def _qualified(node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def _count_nodes(graph, counts: Counter) -> None:
    for node in graph.node:
        counts[_qualified(node)] += 1
        for attr in node.attribute:
            if attr.g is not None and attr.g.node:
                _count_nodes(attr.g, counts)
            for sub in attr.graphs:
                _count_nodes(sub, counts)
