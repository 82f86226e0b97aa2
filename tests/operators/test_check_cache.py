"""The operators stage's ONNX export and patch check are reused across runs only while what they read is unchanged."""

from __future__ import annotations

import os

import pytest

import operators.api
import operators.onnx_export
from operators import run_ops
from operators.inventory import OnnxReport
from operators.ops_report import PatchCheck


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path / "cache"))


def _counted(monkeypatch, module, name):
    real, calls = getattr(module, name), []

    def counting(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_a_second_run_reuses_both_until_the_weights_change(zoo, tmp_path, own_cache, monkeypatch):
    src = zoo("llama")
    exports = _counted(monkeypatch, operators.onnx_export, "export_onnx")
    checks = _counted(monkeypatch, operators.api, "check_kernel_plan")
    first = run_ops(str(src), out_dir=tmp_path / "first")
    assert first.onnx.exported and first.onnx.checker == "ok" and first.patch_check.passed
    assert (exports, checks) == (["export_onnx"], ["check_kernel_plan"])
    assert "reused" not in first.patch_check.note

    second = run_ops(str(src), out_dir=tmp_path / "second")
    assert (exports, checks) == (["export_onnx"], ["check_kernel_plan"])  # neither ran again
    assert second.onnx == first.onnx and second.onnx_blocks == first.onnx_blocks
    assert (tmp_path / "second" / "model.onnx").read_bytes() == (tmp_path / "first" / "model.onnx").read_bytes()
    assert second.patch_check.passed and "reused: passed on" in second.patch_check.note
    assert second.patch_check.logits_max_abs_diff == first.patch_check.logits_max_abs_diff

    weights = next(src.glob("*.safetensors"))
    stat = os.stat(weights)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # weights rewritten: same structure
    third = run_ops(str(src), out_dir=tmp_path / "third")
    assert exports == ["export_onnx"]  # the graph holds no weights: still reused
    assert checks == ["check_kernel_plan"] * 2 and "reused" not in third.patch_check.note


def test_a_failed_patch_check_is_run_again(zoo, tmp_path, own_cache, monkeypatch):
    failing = PatchCheck(True, passed=False, note="logits differ")
    calls = []
    monkeypatch.setattr(operators.api, "check_kernel_plan", lambda *a, **k: calls.append(1) or failing)
    for run in ("first", "second"):
        report = run_ops(str(zoo("llama")), out_dir=tmp_path / run, onnx=False)
        assert not report.patch_check.passed and report.patch_check.note == "logits differ"
    assert len(calls) == 2


def test_a_failed_export_is_kept_as_found(zoo, tmp_path, own_cache, monkeypatch):
    """The exporter's verdict on a structure does not change between runs (Qwen3-MoE's grouped GEMM has no ONNX
    translation): its failure is reused like a success, and no stale graph is written."""
    refused = OnnxReport(False, error="DispatchError: No ONNX function found")
    calls = []
    monkeypatch.setattr(operators.onnx_export, "export_onnx", lambda *a, **k: calls.append(1) or refused)
    for run in ("first", "second"):
        report = run_ops(str(zoo("llama")), out_dir=tmp_path / run, check_patch=False)
        assert report.onnx == refused and not (tmp_path / run / "model.onnx").exists()
    assert len(calls) == 1
