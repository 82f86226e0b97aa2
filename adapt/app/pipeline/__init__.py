"""``adapt run``: intake → operators → plan → environment → alignment → throughput → soak → report.

Public API::

    from adapt.app.pipeline import RunOptions, run_pipeline, select_stages, STAGE_NAMES
    outcome = run_pipeline(RunOptions(source="examples/tiny-llama", out_dir="runs/tiny-llama"))
    outcome.exit_code, outcome.report["status"], outcome.records["alignment"].summary
"""

from adapt.app.pipeline.options import STAGE_NAMES, RunOptions, select_stages
from adapt.app.pipeline.progress import RunProgress, report_progress
from adapt.app.pipeline.runner import RunOutcome, exit_code_of, run_pipeline
from adapt.app.pipeline.store import RunStore, StageRecord, source_fingerprint

__all__ = [
    "STAGE_NAMES",
    "RunOptions",
    "RunOutcome",
    "RunProgress",
    "RunStore",
    "StageRecord",
    "exit_code_of",
    "report_progress",
    "run_pipeline",
    "select_stages",
    "source_fingerprint",
]
