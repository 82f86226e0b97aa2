"""Validation stages: environment, alignment (full or streamed), throughput, soak.

Each stage takes the previous stages' results and returns a dataclass with ``passed`` and
``to_dict()``:

- ``check_environment(plan=None, precision="bf16", device=None) -> EnvReport``
- ``align(src, kernel_plan, dtype, device, streamed=False, thresholds=None) -> AlignmentReport``
- ``bench(src, kernel_plan, device, options=BenchOptions()) -> ThroughputReport`` (with planner calibration)
- ``soak(src, kernel_plan, steps, ckpt_every, ...) -> SoakReport``
"""

from validators.align import AlignmentReport, AlignOptions, align
from validators.compare import LayerResult, Thresholds
from validators.environment import EnvReport, check_environment
from validators.soak import SoakReport, soak
from validators.throughput import BenchOptions, ThroughputReport, bench

__all__ = [
    "AlignOptions", "AlignmentReport", "BenchOptions", "EnvReport", "LayerResult", "SoakReport", "Thresholds",
    "ThroughputReport", "align", "bench", "check_environment", "soak",
]  # fmt: skip
