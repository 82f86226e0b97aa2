"""The validators' live per-block progress must not reach into compiled blocks.

Blocks compile with their forward hooks.  A progress hook that Dynamo traced guarded on each block's label and
recompiled per block (on the H200, alignment of the Llama-3.2-1B shape passed Dynamo's recompile limit at block 8,
leaving the rest eager); the hook is one object for every block and stays outside the compiled graphs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._dynamo.utils import counters

from adapt.app.pipeline.progress import RunProgress
from adapt.app.pipeline.stages import AdaptedTransform

BLOCKS = 12  # past Dynamo's default recompile limit of 8


class _NoPatch:
    def revert(self) -> None:
        pass


def test_progress_hooks_stay_out_of_compiled_blocks_and_report_every_block():
    torch._dynamo.reset()
    counters.clear()
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(BLOCKS)))
    labels: list[str] = []
    with RunProgress(quiet=True) as display, display.stage("alignment") as update:  # rich's display, as a run has it

        def callback(done: int, total: int, label: str) -> None:
            labels.append(label)
            update(done, total, label)

        transform = AdaptedTransform(kernel_plan=None, block_progress=([str(i) for i in range(BLOCKS)], callback))
        transform.apply_kernel_plan = lambda model, plan: _NoPatch()  # no kernels: only the hooks are under test
        transform(model)
        for block in model:
            block.compile(backend="aot_eager")
        x = torch.randn(2, 8)
        for block in model:
            x = block(x)
        transform.revert()
    assert labels == [f"candidate {i}" for i in range(BLOCKS)]
    assert not counters["graph_break"], list(counters["graph_break"])  # traced, rich's lock broke every block's graph
    assert counters["frames"]["total"] <= 2  # traced, one frame per block's label
