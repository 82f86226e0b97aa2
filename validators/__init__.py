"""Validation stages: environment, alignment (full or streamed), throughput, soak.

Each stage takes the previous stages' results and returns a dataclass with ``passed`` and
``to_dict()``:

- ``check_environment(plan=None, precision="bf16", device=None) -> EnvReport``
- ``align(src, kernel_plan, dtype, device, streamed=False, thresholds=None) -> AlignmentReport``
- ``bench(src, kernel_plan, device, options=BenchOptions()) -> ThroughputReport`` (with planner calibration)
- ``soak(src, kernel_plan, steps, ckpt_every, ...) -> SoakReport``

Names are imported on first use: the ``pytest11`` plugin in ``adapt.app.pytest_plugin`` loads this
package in every pytest run, which must not pay for torch unless ``--adapt-model`` is given.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AlignOptions": "validators.align", "AlignmentReport": "validators.align", "align": "validators.align",
    "LayerResult": "validators.compare", "Thresholds": "validators.compare",
    "EnvReport": "validators.environment", "check_environment": "validators.environment",
    "SoakReport": "validators.soak", "soak": "validators.soak",
    "BenchOptions": "validators.throughput", "ThroughputReport": "validators.throughput", "bench": "validators.throughput",
}  # fmt: skip

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'validators' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
