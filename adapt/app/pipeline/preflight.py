"""Everything about a run's input that can be judged before the first stage starts.

Stage selection, ``--cluster``, the thresholds file and the model config are checked here, so a
bad value costs well under a second and never a partial run: each failure is ``BadInput`` (exit 2)
with one line naming the option or field, its value and what is allowed.
"""

from __future__ import annotations

from typing import Any

from adapt.app.pipeline.options import STAGE_NAMES, PlanOptions, RunOptions, ValidationOptions
from adapt.core.errors import BadInput
from adapt.core.inputs import check_with_transformers

# What each stage reads from earlier stages: a selection without them cannot run.  Mirrors
# ``Stage.needs`` in adapt.app.pipeline.stages, which imports torch-heavy code this module must not load.
STAGE_NEEDS: dict[str, tuple[str, ...]] = {
    "plan": ("intake",),
    "alignment": ("operators",),
    "throughput": ("operators",),
    "replan": ("intake", "plan"),
    "soak": ("operators",),
}


def check_stage_selection(stages: list[str]) -> None:
    for name in stages:
        missing = [need for need in STAGE_NEEDS.get(name, ()) if need not in stages]
        if missing:
            runnable = ",".join(s for s in STAGE_NAMES if s in stages or s in missing)
            raise BadInput(
                f"--stages {','.join(stages)}: {name} needs the {', '.join(missing)} stage; "
                f"allowed: a selection with what it needs, e.g. --stages {runnable}"
            )


def check_options(options: RunOptions) -> None:
    """The options alone (no source read yet): stage selection, cluster and thresholds."""
    stages, cluster, thresholds = options.run.stages, options.plan.cluster, options.validation.thresholds
    check_stage_selection(stages)
    if cluster is not None and ("plan" in stages or "environment" in stages):
        _check_cluster(cluster)  # None: the device chooses the target once the source is resolved
    if thresholds is not None:
        from reports.judge import load_thresholds

        load_thresholds(thresholds)


def _check_cluster(text: str) -> None:
    try:
        from parallel_planner.cluster import parse_cluster_option
    except ImportError:  # no planner installed: the plan stage itself reports it as unavailable
        return
    parse_cluster_option(text)


def check_source_config(handle: Any) -> None:
    """transformers' own validation of the resolved config (adapt's checks ran when it was resolved)."""
    config = getattr(handle, "config_dict", None)
    if isinstance(config, dict) and config:
        check_with_transformers(config, str(getattr(handle, "config_path", "config.json")))


def plan_seq_len_notes(options: PlanOptions, handle: Any) -> list[str]:
    """Cap the plan's sequence length at the model's maximum position, saying so in the plan's notes."""
    config = getattr(handle, "config_dict", None) or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    max_positions = text.get("max_position_embeddings")
    if not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions < 1:
        return []
    if options.plan_seq_len <= max_positions:
        return []
    asked = options.plan_seq_len
    options.plan_seq_len = max_positions
    note = f"plan sequence length capped at {max_positions}, the model's max_position_embeddings "
    return [note + f"(--plan-seq-len asked for {asked})"]


VALIDATING_STAGES = ("alignment", "generation", "throughput", "soak")


def check_validation_shape(options: ValidationOptions, stages: list[str], positions: int | None, config: dict) -> None:
    """The validation batch the user asked for must fit the model and this host: a sequence past the model's
    positions, or a CPU batch whose logits alone exceed the free memory, is bad input before any stage starts
    (on the CPU the kernel's OOM killer would end the run without a report)."""
    if not any(s in stages for s in VALIDATING_STAGES) or options.seq_len is None or options.batch_size is None:
        return
    if positions is not None and options.seq_len > positions:
        raise BadInput(f"--seq-len is {options.seq_len}; allowed: 1 to {positions}, the model's maximum positions")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab = text.get("vocab_size")
    if options.device != "cpu" or not isinstance(vocab, int) or vocab < 1:
        return
    import psutil

    logits = options.batch_size * options.seq_len * vocab * 8  # float64 reference logits
    free = psutil.virtual_memory().available
    if logits > 0.9 * free:
        raise BadInput(
            f"--batch-size {options.batch_size} x --seq-len {options.seq_len}: the reference logits alone need "
            f"{logits / 2**30:.1f} GiB and this host has {free / 2**30:.1f} GiB free; allowed: a smaller batch"
        )
