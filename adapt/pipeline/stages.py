"""The pipeline's stages: each calls one stage function of its owning package and judges it.

Every stage is an adapter around a public function (``adapt.intake.build_spec``,
``operators.run_ops``, ``parallel_planner.plan_parallel``, ``validators.check_environment /
align / bench / soak``).  The adapter gathers the arguments from the options and the upstream
typed results, calls the function, and turns its ``to_dict()`` into the normalised summary that
the reports render (see ``adapt.pipeline.summaries``).  A stage function that is not importable
fails its stage with that message; nothing here ever invents a result.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import shutil
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapt.errors import BadInput
from adapt.pipeline import summaries
from adapt.pipeline.options import RunOptions
from adapt.pipeline.progress import ProgressCallback


class StageUnavailable(RuntimeError):
    """The function a stage needs cannot be imported (its package is missing or incomplete)."""


class StageBlocked(RuntimeError):
    """An upstream result this stage needs is not available."""


@dataclass
class StageContext:
    options: RunOptions
    source: Any  # adapt.intake.ModelSource (or the path when intake is unavailable)
    artifacts: Path
    progress: ProgressCallback
    key: str  # this stage's cache key (names per-key artefacts such as soak checkpoints)
    upstream: Callable[[str], Any]  # name -> typed result of an upstream stage (rebuilt on demand)
    optional_upstream: Callable[[str], Any]  # same, but None when that stage is not part of this run
    notes: list[str] = field(default_factory=list)  # what the report should say about this run of the stage


@dataclass(frozen=True)
class Stage:
    name: str
    needs: tuple[str, ...]  # upstream stages whose typed results ``execute`` reads
    option_keys: tuple[str, ...]  # RunOptions fields that change the result (part of the cache key)
    execute: Callable[[StageContext], Any]
    summarise: Callable[[dict[str, Any], RunOptions], summaries.Summary]
    description: str = ""
    uses: tuple[str, ...] = ()  # upstream stages read when they are part of the run, not required


def require(module: str, attr: str, *fallbacks: str) -> Any:
    """Import ``module.attr`` (or ``fallback.attr`` for a package that has not re-exported it yet).

    Raises StageUnavailable with the reason when none provides it.
    """
    reasons = []
    for name in (module, *fallbacks):
        try:
            mod = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any import failure makes the stage unavailable
            reasons.append(f"{name} is not importable ({type(err).__name__}: {err})")
            continue
        found = getattr(mod, attr, None)
        if found is not None and not isinstance(found, types.ModuleType):  # ``validators.align`` may be the submodule
            return found
        reasons.append(f"{name} does not provide {attr}() yet")
    raise StageUnavailable("; ".join(reasons))


def call_stage_function(fn: Callable[..., Any], ctx: StageContext, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with ``args`` and those ``kwargs`` its signature accepts.

    Options a stage function does not take are recorded as notes, so the report states which
    requested settings the stage could not honour instead of pretending they applied.
    """
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = {k: v for k, v in kwargs.items() if takes_any or k in params}
    ignored = sorted(k for k, v in kwargs.items() if k not in accepted and k != "progress" and v is not None)
    if ignored:
        ctx.notes.append(f"{fn.__module__}.{fn.__name__} takes no {', '.join(ignored)}: its own defaults applied")
    return fn(*args, **accepted)


def to_result_dict(result: Any) -> dict[str, Any]:
    if hasattr(result, "to_dict"):
        return result.to_dict()
    raise TypeError(f"stage returned {type(result).__name__}, which has no to_dict()")


# ---- stage adapters -------------------------------------------------------------------------


def _intake(ctx: StageContext) -> Any:
    build_spec = require("adapt.intake", "build_spec")
    return build_spec(ctx.source)


def _operators(ctx: StageContext) -> Any:
    run_ops = require("operators", "run_ops")
    return call_stage_function(
        run_ops, ctx, ctx.source, profile=ctx.options.profile, out_dir=str(ctx.artifacts), progress=ctx.progress
    )


def kernel_plan_of(ops_report: Any) -> Any:
    """The KernelPlan inside the operators stage's result (``OpsReport.plan``)."""
    plan = getattr(ops_report, "plan", None)
    if plan is None:
        raise StageBlocked("the operators result carries no kernel plan")
    return plan


class AdaptedTransform:
    """The candidate transform the validators apply to a fresh model: the kernel plan, patched in place.

    ``operators.apply_kernel_plan`` returns a PatchHandle, not the model; the transform returns the
    patched model itself and keeps the handles, which ``revert`` undoes when the stage ends (patches
    register state outside the model, which must not outlive it).  With ``block_progress`` (block
    module paths from intake, a callback), each block's forward moves the live progress bar; those
    hooks return None, so outputs are untouched.
    """

    def __init__(self, kernel_plan: Any, block_progress: tuple[list[str], ProgressCallback] | None = None):
        self.apply_kernel_plan = require("operators", "apply_kernel_plan")
        self.kernel_plan = kernel_plan
        self.block_progress = block_progress
        self.handles: list[Any] = []
        self.hooks: list[Any] = []

    def __call__(self, model: Any) -> Any:
        self.handles.append(self.apply_kernel_plan(model, self.kernel_plan))
        if self.block_progress is not None:
            paths, callback = self.block_progress
            for index, path in enumerate(paths):
                try:
                    block = model.get_submodule(path)
                except AttributeError:  # display only: a path the loaded class lays out differently shows no bar
                    continue
                hook = functools.partial(_block_done, callback, index + 1, len(paths), f"candidate {path}")
                self.hooks.append(block.register_forward_hook(hook))
        return model

    def revert(self) -> None:
        for hook in self.hooks:
            hook.remove()
        for handle in reversed(self.handles):
            handle.revert()
        self.hooks.clear()
        self.handles.clear()


def call_with_candidate(fn: Callable[..., Any], ctx: StageContext, transform: AdaptedTransform, *args, **kwargs) -> Any:
    """``call_stage_function`` with ``transform=``, reverting every patch it made once the stage returns."""
    try:
        return call_stage_function(fn, ctx, *args, transform=transform, **kwargs)
    finally:
        transform.revert()


def _block_done(callback: ProgressCallback, done: int, total: int, label: str, *hook_args: Any) -> None:
    callback(done, total, label)


def _plan(ctx: StageContext) -> Any:
    cluster, workload = cluster_and_workload(ctx.options)  # bad --cluster is bad input even before planning
    plan_parallel = require("parallel_planner", "plan_parallel", "parallel_planner.search")
    return plan_parallel(ctx.upstream("intake"), cluster, workload, top_k=5)


def cluster_and_workload(options: RunOptions) -> tuple[Any, Any]:
    """The planner's Cluster (from ``--cluster``) and Workload (from the plan options)."""
    workload_cls = require("parallel_planner.workload", "Workload")
    workload = workload_cls(
        seq_len=options.plan_seq_len, global_batch=options.plan_global_batch, mode="train", precision=options.precision
    )
    return parse_cluster(options.cluster), workload


_CLUSTER_SPEC = re.compile(r"^\s*(\d+)\s*[x×*]\s*([A-Za-z0-9_.\-]+)\s*$")


def parse_cluster(text: str) -> Any:
    """``8xH100`` (count x catalogue GPU), a cluster YAML/TOML file, or ``local`` (this machine)."""
    if text == "local":
        return require("parallel_planner.cluster", "local_cluster")()
    match = _CLUSTER_SPEC.match(text)
    if match:
        return require("parallel_planner.cluster", "make_cluster")(match.group(2), int(match.group(1)))
    if Path(text).is_file():
        return require("parallel_planner.cluster", "load_cluster_file")(text)
    raise BadInput(f"--cluster {text!r}: expected <N>x<GPU> (e.g. 8xH100), a cluster file, or 'local'")


def best_parallel_plan(planner_result: Any) -> Any:
    plans = getattr(planner_result, "plans", None) or []
    if not plans:
        raise StageBlocked("the planner found no layout that fits")
    return plans[0].plan


def _environment(ctx: StageContext) -> Any:
    """Check this machine; against the plan only when this machine is meant to run it.

    The plan targets ``--cluster``.  A CPU validation run (``--device cpu``) with a GPU cluster
    plan is the normal Day-0 case, so the plan's GPU count is then not held against this machine.
    """
    check_environment = require("validators", "check_environment", "validators.environment")
    opts = ctx.options
    planner_result = ctx.optional_upstream("plan")
    plan = None
    if planner_result is not None and (opts.cluster == "local" or opts.device.startswith("cuda")):
        plan = best_parallel_plan(planner_result)
    elif planner_result is not None:
        ctx.notes.append(
            f"the plan targets {opts.cluster}, not this {opts.device} machine: its GPU needs are not checked here"
        )
    return call_stage_function(check_environment, ctx, plan=plan, precision=opts.precision, device=opts.device)


def _alignment(ctx: StageContext) -> Any:
    align = require("validators", "align", "validators.align")
    kernel_plan = kernel_plan_of(ctx.upstream("operators"))
    opts = ctx.options
    align_options = require("validators.align", "AlignOptions")(batch=opts.batch_size, seq_len=opts.seq_len)
    return call_with_candidate(
        align,
        ctx,
        AdaptedTransform(kernel_plan, _block_progress(ctx)),
        ctx.source,
        kernel_plan,
        dtype=opts.candidate_dtype,
        device=opts.device,
        thresholds=alignment_thresholds(opts),
        options=align_options,
        progress=ctx.progress,
    )


def _block_progress(ctx: StageContext) -> tuple[list[str], ProgressCallback] | None:
    """Block module paths from the intake result (when this run has one) for live per-block progress."""
    spec = ctx.optional_upstream("intake")
    return ([block.module for block in spec.blocks], ctx.progress) if spec is not None else None


def alignment_thresholds(options: RunOptions) -> dict[str, float] | None:
    """The ``alignment`` section of ``--thresholds`` (the gate's file format) for the run's dtype."""
    if options.thresholds is None:
        return None
    from reports.judge import alignment_limits, load_thresholds

    return alignment_limits(load_thresholds(options.thresholds).get("alignment", {}), options.candidate_dtype) or None


def _generation(ctx: StageContext) -> Any:
    """Greedy generation of the adapted model against the unadapted one: tokens, log-probs, cache, batch."""
    generation_check = require("validators.generation", "generation_check")
    kernel_plan = kernel_plan_of(ctx.upstream("operators"))
    opts = ctx.options
    return call_with_candidate(
        generation_check,
        ctx,
        AdaptedTransform(kernel_plan),
        ctx.source,
        kernel_plan,
        dtype=opts.candidate_dtype,
        device=opts.device,
        thresholds=alignment_thresholds(opts),
    )


def _generation_summary(result: dict[str, Any], options: RunOptions) -> summaries.Summary:
    """The generation check's own verdict and summary line, with the fields a report table needs."""
    keys = ("verdict", "dtype", "device", "reference_dtype", "seed", "prompt_lengths", "new_tokens", "checks", "ties",
            "first_divergence", "cache_kinds", "applicable")  # fmt: skip
    return summaries.Summary(bool(result.get("passed")), str(result.get("summary", "")), {k: result.get(k) for k in keys})


def _throughput(ctx: StageContext) -> Any:
    bench = require("validators", "bench", "validators.throughput")
    kernel_plan = kernel_plan_of(ctx.upstream("operators"))
    opts = ctx.options
    bench_options = require("validators.throughput", "BenchOptions")(
        dtype=opts.candidate_dtype, seq_len=opts.seq_len, batch=opts.batch_size, steps=opts.bench_steps
    )
    return call_with_candidate(
        bench,
        ctx,
        AdaptedTransform(kernel_plan),
        ctx.source,
        kernel_plan,
        device=opts.device,
        options=bench_options,
        progress=ctx.progress,
    )


def _soak(ctx: StageContext) -> Any:
    """Checkpoints live under the stage key: an interrupted soak resumes, a changed or forced one starts over."""
    soak = require("validators", "soak", "validators.soak")
    kernel_plan = kernel_plan_of(ctx.upstream("operators"))
    opts = ctx.options
    ckpt_dir = ctx.artifacts / f"checkpoints-{ctx.key}"
    for stale in ctx.artifacts.glob("checkpoints-*"):
        if stale != ckpt_dir or opts.force:
            shutil.rmtree(stale)
    return call_with_candidate(
        soak,
        ctx,
        AdaptedTransform(kernel_plan),
        ctx.source,
        kernel_plan,
        steps=opts.soak_steps,
        ckpt_every=opts.ckpt_every,
        device=opts.device,
        dtype=opts.candidate_dtype,
        seq_len=opts.seq_len,
        batch_size=opts.batch_size,
        ckpt_dir=str(ckpt_dir),
        progress=ctx.progress,
    )


_SOURCE_KEYS = ("trust_remote_code", "allow_pickle")

STAGES: dict[str, Stage] = {
    stage.name: stage
    for stage in (
        Stage("intake", (), _SOURCE_KEYS, _intake, summaries.intake, "read the checkpoint into a ModelSpec"),
        Stage("operators", (), (*_SOURCE_KEYS, "profile"), _operators, summaries.operators, "map every op to a kernel"),
        Stage(
            "plan",
            ("intake",),
            ("cluster", "plan_seq_len", "plan_global_batch", "precision"),
            _plan,
            summaries.plan,
            "lay the model out on the cluster",
        ),
        Stage(
            "environment",
            (),
            ("precision", "device", "cluster"),
            _environment,
            summaries.environment,
            "check this machine",
            ("plan",),
        ),
        Stage(
            "alignment",
            ("operators",),
            ("device", "dtype", "seq_len", "batch_size", "thresholds"),
            _alignment,
            summaries.alignment,
            "compare the adapted model with a float64 reference, block by block",
            ("intake",),
        ),
        Stage(
            "generation",
            ("operators",),
            ("device", "dtype", "thresholds"),
            _generation,
            _generation_summary,
            "generate greedily against the unadapted model: tokens, log-probs, KV cache, left-padded batches",
        ),
        Stage(
            "throughput",
            ("operators",),
            ("device", "dtype", "seq_len", "batch_size", "bench_steps"),
            _throughput,
            summaries.throughput,
            "measure baseline against adapted",
        ),
        Stage(
            "soak",
            ("operators",),
            ("device", "dtype", "seq_len", "batch_size", "soak_steps", "ckpt_every"),
            _soak,
            summaries.soak,
            "train for a while and watch loss, time and memory",
        ),
    )
}
