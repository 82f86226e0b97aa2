"""A generated kernel that gives way to its module's own forward during a validation stage is said in that stage's
notes: what the stage measured there was the module's forward, not the planned kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from shared_modules import ScanOverTime
from torch import nn

from adapt.app.pipeline.stages import StageContext, candidate
from operators.generated import compile_module
from operators.patch import PatchHandle


def _generated_kernel_patch(model: nn.Module, plan: object) -> PatchHandle:
    """What ``apply_kernel_plan`` installs for a generated choice: the compiled forward, its fallbacks on the handle."""
    handle = PatchHandle(model)
    model.forward = compile_module(model, "model.layers.0.scan", handle.fallbacks.append)
    handle.releases.append(lambda: model.__dict__.pop("forward", None))
    return handle


def _context(tmp_path: Path) -> StageContext:
    return StageContext(
        options=None,
        source=None,
        artifacts=tmp_path,
        progress=lambda *a: None,
        key="k",
        upstream=lambda name: None,
        optional_upstream=lambda name: None,
    )


def test_a_fallback_during_the_stage_lands_in_its_notes_once(tmp_path):
    torch._dynamo.reset()
    ctx, model = _context(tmp_path), ScanOverTime()
    with torch._dynamo.config.patch(recompile_limit=2), pytest.warns(UserWarning, match="recompiled past"):
        with candidate(ctx, kernel_plan=None) as transform:
            transform.apply_kernel_plan = _generated_kernel_patch
            adapted = transform(model)
            for length in (3, 4, 5, 6, 7):
                x = torch.randn(2, length, 4, dtype=torch.float64)
                torch.testing.assert_close(adapted(x), ScanOverTime.forward(model, x))
    assert len(ctx.notes) == 1
    assert ctx.notes[0].startswith("fallback: model.layers.0.scan") and "runs its own forward" in ctx.notes[0]
    assert "forward" not in model.__dict__  # the patch was reverted with the stage


def test_a_stage_without_fallbacks_adds_no_note(tmp_path):
    ctx, model = _context(tmp_path), ScanOverTime()
    with candidate(ctx, kernel_plan=None) as transform:
        transform.apply_kernel_plan = lambda m, plan: PatchHandle(m)
        transform(model)(torch.randn(1, 3, 4))
    assert ctx.notes == []
