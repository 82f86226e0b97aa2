"""The operators stage's two slow checks, kept across runs: the ONNX export and the patch check.

Both give the same answer whenever what they read is the same, yet cost seconds on every run (the
exporter's tracing; two forward and backward passes in float32), and together they were most of a warm
stage (3.7 and 2.6 s of 8.2 s for Llama-3.2-1B on the H200).  So each is stored under a key of all it
depends on, in the timing cache's directory (``timing_cache.cache_dir``) and with its environment (device,
torch, triton, transformers, adapt):

* the export reads the model's structure, not its weights (they leave the graph as inputs): the key is the
  checkpoint's ``content_hash`` (config, code, tensor names, shapes and dtypes), the onnx and onnxscript
  versions and adapt's own source.  The graph is kept beside its report and copied to the run's directory.
* the patch check reads the weights: the key adds each weight file's size and modification time, and the
  plan's choices (not its timings, which vary between cold runs that choose alike).

An export that failed is kept too (the exporter's verdict on a structure is the same every time); a patch
check is kept only when it passed, so that a failure is run again and shows its live figures.  A reused
patch check says so in its note.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapt.core.source import ModelSource
from operators.inventory import OnnxReport
from operators.mapping import KernelPlan
from operators.ops_report import PatchCheck
from operators.timing_cache import DiskCache, adapt_code_digest, cache_dir, make_key, package_version


def _weights_stamp(source: ModelSource) -> list[tuple[str, int, int]]:
    return [(os.path.basename(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in sorted(source.weight_files)]


def _plan_choices(plan: KernelPlan) -> list[Any]:
    """What applying the plan installs: per component its kernel and variant, and the compile mode."""
    chosen = [
        [c.module, c.kind, c.provider, c.kernel, c.patch, c.backend, c.variant.to_dict()] for c in plan.components
    ]
    return [chosen, plan.compile.get("mode"), plan.compile.get("cuda_graphs", False)]


def _onnx_key(source: ModelSource, device: str) -> str:
    exporters = {name: package_version(name) for name in ("onnx", "onnxscript")}
    return make_key(device, "onnx-export", source.content_hash(), exporters, adapt_code_digest())


def cached_onnx(
    source: ModelSource,
    device: str,
    out: Path | None,
    export: Callable[[Path | None], tuple[OnnxReport, dict[str, int] | None]],
) -> tuple[OnnxReport, dict[str, int] | None]:
    """``export(path)``'s result, from the cache when this structure was exported before on this software."""
    key = _onnx_key(source, device)
    store, graphs = DiskCache("onnx_exports"), cache_dir() / "onnx"
    kept = store.get(key)
    graph = graphs / f"{key}.onnx"
    if kept and (out is None or not kept["report"]["exported"] or graph.is_file()):
        if out is not None and kept["report"]["exported"]:
            shutil.copyfile(graph, out / "model.onnx")
        return OnnxReport(**kept["report"]), kept.get("blocks")
    report, blocks = export(out / "model.onnx" if out is not None else None)
    written = out / "model.onnx" if out is not None else None
    if report.exported and written is not None and written.is_file():
        graphs.mkdir(parents=True, exist_ok=True)
        tmp = graphs / f".{key}.onnx.tmp"
        shutil.copyfile(written, tmp)
        os.replace(tmp, graph)
    if not report.exported or written is None or graph.is_file():
        store.put(key, {"report": dataclasses.asdict(report), "blocks": blocks, "at": _now()})
    return report, blocks


def cached_patch_check(
    source: ModelSource, device: str, plan: KernelPlan, check: Callable[[], PatchCheck]
) -> PatchCheck:
    """``check()``'s result, from the cache when these weights were checked under the same choices before."""
    key = make_key(
        device, "patch-check", source.content_hash(), _weights_stamp(source), _plan_choices(plan), adapt_code_digest()
    )
    store = DiskCache("patch_checks")
    kept = store.get(key)
    if kept:
        result = PatchCheck(**kept["result"])
        result.note = (
            f"{result.note}; " if result.note else ""
        ) + f"reused: passed on {kept['at']} (same weights, plan choices and software)"
        return result
    result = check()
    if result.ran and result.passed:
        store.put(key, {"result": dataclasses.asdict(result), "at": _now()})
    return result


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
