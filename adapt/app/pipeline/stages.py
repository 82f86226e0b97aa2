"""The pipeline's stages: each adapter calls one stage function of its owning package and judges it.

Each adapter imports its stage function from the module that defines it (``adapt.model.intake.build_spec``,
``operators.run_ops``, ``parallel_planner.search.plan_parallel``, ``validators.environment.
check_environment``, ``validators.align.align``, ``validators.throughput.bench``,
``parallel_planner.replan.replan``, ``validators.soak.soak``) and calls it with explicit arguments taken
from the options and the upstream typed results.  The imports sit inside the adapters so that ``adapt --help`` does not pay
for torch, and so that a package that cannot be imported fails only its own stage.

Adding a stage: write its adapter (and, when later stages read its typed result, a loader that
rebuilds it with the result type's ``from_dict``), add a ``Stage`` to ``STAGES`` and its name to
``options.STAGE_NAMES``.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapt.app.pipeline.options import LOCAL_CLUSTER, RunOptions, ValidationOptions
from adapt.app.pipeline.progress import ProgressCallback
from adapt.core.stage_verdicts import StageSummary, SummaryContext

CALIBRATION_FILE = "calibration.json"  # the throughput stage's measurements, in its artifacts directory


class StageUnavailable(RuntimeError):
    """A module the stage needs cannot be imported (its package is missing or incomplete)."""


class StageBlocked(RuntimeError):
    """An upstream result this stage needs is not available."""


@dataclass
class StageContext:
    options: RunOptions
    source: Any  # adapt.core.source.ModelSource
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
    description: str = ""
    uses: tuple[str, ...] = ()  # upstream stages read when they are part of the run, not required
    # The typed result from its stored ``to_dict()``; None: a later stage that needs it re-runs this one.
    load: Callable[[dict[str, Any]], Any] | None = None
    # What the result depends on besides the source and the options (this machine, library versions): part of the key.
    environment: Callable[[], dict[str, Any]] | None = None

    def key_environment(self) -> dict[str, Any] | None:
        """``environment()`` for the cache key; a stage whose package cannot be imported fails when it runs."""
        if self.environment is None:
            return None
        try:
            return self.environment()
        except ImportError as err:
            return {"unavailable": str(err)}

    def run(self, ctx: StageContext) -> Any:
        """``execute``, with a module that cannot be imported reported as this stage being unavailable."""
        try:
            return self.execute(ctx)
        except ImportError as err:
            raise StageUnavailable(f"{err.name or 'a module'} is not importable ({type(err).__name__}: {err})") from err


def to_result_dict(result: Any) -> dict[str, Any]:
    if hasattr(result, "to_dict"):
        return result.to_dict()
    raise TypeError(f"stage returned {type(result).__name__}, which has no to_dict()")


def summary_context(options: RunOptions) -> SummaryContext:
    """The run facts a stage's summary states, and the thresholds file's sections its verdict is judged with."""
    from reports.judge import load_thresholds

    plan, validation = options.plan, options.validation
    return SummaryContext(
        device=validation.device,
        dtype=validation.dtype,
        seq_len=validation.seq_len,
        batch_size=validation.batch_size,
        cluster=str(plan.cluster),
        local_cluster=plan.cluster == LOCAL_CLUSTER,
        plan_seq_len=plan.plan_seq_len,
        plan_global_batch=plan.plan_global_batch,
        precision=plan.precision,
        thresholds=load_thresholds(validation.thresholds),
    )


def summarise(result: Any, context: SummaryContext) -> StageSummary:
    """The stage result's own summary and verdict: every result type judges itself (``summary(context)``)."""
    if hasattr(result, "summary"):
        return result.summary(context)
    raise TypeError(f"stage returned {type(result).__name__}, which has no summary()")


# ---- intake ---------------------------------------------------------------------------------


def _intake(ctx: StageContext) -> Any:
    from adapt.model.intake import build_spec

    return build_spec(ctx.source)


def _load_spec(data: dict[str, Any]) -> Any:
    from adapt.core.spec import ModelSpec

    return ModelSpec.from_dict(data)


# ---- operators ------------------------------------------------------------------------------


def _operators(ctx: StageContext) -> Any:
    from operators import run_ops

    spec = ctx.optional_upstream("intake")  # with it, the report says where intake and the recognition disagree
    return run_ops(ctx.source, profile=ctx.options.operators.profile, out_dir=str(ctx.artifacts), spec=spec)


def _load_ops_report(data: dict[str, Any]) -> Any:
    """The stored operators result as an OpsReport: later stages get its kernel plan without a re-run."""
    from operators.ops_report import OpsReport

    return OpsReport.from_dict(data)


def _operators_environment() -> dict[str, Any]:
    from operators.api import ops_environment

    return ops_environment()


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
        from operators import apply_kernel_plan

        self.apply_kernel_plan = apply_kernel_plan
        self.kernel_plan = kernel_plan
        self.block_progress = block_progress
        self.handles: list[Any] = []
        self.hooks: list[Any] = []

    def __call__(self, model: Any) -> Any:
        self.handles.append(self.apply_kernel_plan(model, self.kernel_plan))
        if self.block_progress is not None:
            paths, callback = self.block_progress
            positions: dict[int, tuple[int, int, str]] = {}
            blocks = []
            for index, path in enumerate(paths):
                try:
                    block = model.get_submodule(path)
                except AttributeError:  # display only: a path the loaded class lays out differently shows no bar
                    continue
                positions[id(block)] = (index + 1, len(paths), f"candidate {path}")
                blocks.append(block)
            hook = _progress_hook(callback, positions)
            self.hooks += [block.register_forward_hook(hook) for block in blocks]
        return model

    def fallbacks(self) -> list[str]:
        """Generated kernels that gave way to their module's own forward while the stage ran (``PatchHandle``)."""
        return [why for handle in self.handles for why in getattr(handle, "fallbacks", [])]

    def revert(self) -> None:
        for hook in self.hooks:
            hook.remove()
        for handle in reversed(self.handles):
            handle.revert()
        self.hooks.clear()
        self.handles.clear()


@contextlib.contextmanager
def candidate(
    ctx: StageContext, kernel_plan: Any, block_progress: tuple[list[str], ProgressCallback] | None = None
) -> Iterator[AdaptedTransform]:
    """The adapted transform for one validation stage; every patch it made is reverted when the stage returns, and
    a generated kernel that gave way to its module's forward meanwhile is said in the stage's notes: what the stage
    measured ran that forward there, not the planned kernel."""
    transform = AdaptedTransform(kernel_plan, block_progress)
    try:
        yield transform
    finally:
        ctx.notes.extend(dict.fromkeys(f"fallback: {why}" for why in transform.fallbacks()))
        transform.revert()


def _progress_hook(callback: ProgressCallback, positions: dict[int, tuple[int, int, str]]) -> Callable[..., None]:
    """One forward hook for every block, kept out of compiled graphs.  A block compiles with its hooks: a hook Dynamo
    traced would guard on each block's own label, recompiling per block until the recompile limit, after which the
    remaining blocks would run eager inside the very stage that validates them compiled."""
    import torch

    @torch.compiler.disable
    def block_done(module: Any, *hook_args: Any) -> None:
        callback(*positions[id(module)])

    return block_done


# ---- plan -----------------------------------------------------------------------------------


def _plan(ctx: StageContext) -> Any:
    from adapt.app.clusters import target_cluster
    from parallel_planner.search import plan_parallel

    cluster = target_cluster(ctx.options.plan.cluster)  # bad --cluster is bad input even before planning
    return plan_parallel(ctx.upstream("intake"), cluster, plan_workload(ctx.options), top_k=5)


def _load_planner_result(data: dict[str, Any]) -> Any:
    from parallel_planner.result import PlannerResult

    return PlannerResult.from_dict(data)


def plan_workload(options: RunOptions) -> Any:
    """The planner's Workload from the plan options."""
    from parallel_planner.workload import Workload

    plan = options.plan
    return Workload(
        seq_len=plan.plan_seq_len, global_batch=plan.plan_global_batch, mode="train", precision=plan.precision
    )


# ---- environment ----------------------------------------------------------------------------


def _environment(ctx: StageContext) -> Any:
    """Check this machine; against the plan only when the plan targets this machine.

    A CPU validation run with a GPU cluster plan is the normal Day-0 case, and so is planning a
    large cluster from a one-GPU box: the environment validator then notes what it did not check.
    """
    from validators.environment import PlanTarget, check_environment

    opts = ctx.options
    planner_result = ctx.optional_upstream("plan")
    plan, target = None, None
    if planner_result is not None:
        plan = planner_result.plans[0].plan if planner_result.plans else None
        cluster = planner_result.cluster
        target = PlanTarget(
            name=opts.plan.cluster,
            gpu=cluster["gpu"]["name"],
            num_gpus=cluster["num_gpus"],
            gpus_per_node=cluster["gpus_per_node"],
            local=opts.plan.cluster == LOCAL_CLUSTER,
        )
    return check_environment(plan, precision=opts.plan.precision, device=opts.validation.device, target=target)


# ---- validation on this machine ---------------------------------------------------------------


def _alignment(ctx: StageContext) -> Any:
    from validators.align import AlignOptions, align

    opts = ctx.options.validation
    kernel_plan = kernel_plan_of(ctx.upstream("operators"))
    with candidate(ctx, kernel_plan, _block_progress(ctx)) as transform:
        return align(
            ctx.source,
            kernel_plan,
            dtype=opts.dtype,
            device=opts.device,
            thresholds=alignment_thresholds(opts),
            transform=transform,
            options=AlignOptions(batch=opts.batch_size, seq_len=opts.seq_len, seed=opts.seed),
        )


def _block_progress(ctx: StageContext) -> tuple[list[str], ProgressCallback] | None:
    """Block module paths from the intake result (when this run has one) for live per-block progress."""
    spec = ctx.optional_upstream("intake")
    return ([block.module for block in spec.blocks], ctx.progress) if spec is not None else None


def alignment_thresholds(options: ValidationOptions) -> dict[str, float] | None:
    """The ``alignment`` section of ``--thresholds`` (the gate's file format) for the run's dtype."""
    if options.thresholds is None:
        return None
    from adapt.core.stage_verdicts import alignment_limits
    from reports.judge import load_thresholds

    return alignment_limits(load_thresholds(options.thresholds).get("alignment", {}), options.dtype) or None


def _generation(ctx: StageContext) -> Any:
    """Greedy generation of the adapted model against the unadapted one: tokens, log-probs, cache, batch."""
    from validators.generation import GenerationOptions, generation_check

    opts = ctx.options.validation
    kernel_plan = kernel_plan_of(ctx.upstream("operators"))
    with candidate(ctx, kernel_plan) as transform:
        return generation_check(
            ctx.source,
            kernel_plan,
            dtype=opts.dtype,
            device=opts.device,
            thresholds=alignment_thresholds(opts),
            transform=transform,
            options=GenerationOptions(seed=opts.seed),
        )


def _throughput(ctx: StageContext) -> Any:
    from validators.throughput import BenchOptions, bench

    opts = ctx.options.validation
    kernel_plan = kernel_plan_of(ctx.upstream("operators"))
    # a device-chosen batch on a GPU is left to the bench, which sizes the step from free memory
    sized_by_bench = opts.device != "cpu" and "batch_size" in ctx.options.device_chosen
    bench_options = BenchOptions(
        dtype=opts.dtype,
        seq_len=opts.seq_len,
        batch=None if sized_by_bench else opts.batch_size,
        steps=opts.bench_steps,
    )
    with candidate(ctx, kernel_plan) as transform:
        report = bench(ctx.source, kernel_plan, device=opts.device, options=bench_options, transform=transform)
    from adapt.core.jsonio import atomic_write_json

    path = ctx.artifacts / CALIBRATION_FILE
    atomic_write_json(path, report.calibration)  # what ``adapt plan --calibration`` and the re-plan read
    ctx.notes.append(f"measurements for the planner written to {path}")
    return report


def _load_throughput(data: dict[str, Any]) -> Any:
    from validators.throughput import ThroughputReport

    return ThroughputReport.from_dict(data)


# ---- re-plan with this machine's measurements ---------------------------------------------------


def _replan(ctx: StageContext) -> Any:
    """The plan again with the throughput stage's measurements, beside the plan made before them."""
    from parallel_planner.replan import replan

    measured = ctx.optional_upstream("throughput")
    return replan(ctx.upstream("intake"), ctx.upstream("plan"), measured.calibration if measured else None)


def _soak(ctx: StageContext) -> Any:
    """Checkpoints live under the stage key: an interrupted soak resumes, a changed or forced one starts over."""
    from validators.soak import soak

    opts = ctx.options.validation
    kernel_plan = kernel_plan_of(ctx.upstream("operators"))
    ckpt_dir = ctx.artifacts / f"checkpoints-{ctx.key}"
    for stale in ctx.artifacts.glob("checkpoints-*"):
        if stale != ckpt_dir or ctx.options.run.force:
            shutil.rmtree(stale)
    with candidate(ctx, kernel_plan) as transform:
        return soak(
            ctx.source,
            kernel_plan,
            steps=opts.soak_steps,
            ckpt_every=opts.ckpt_every,
            device=opts.device,
            dtype=opts.dtype,
            seq_len=opts.seq_len,
            batch_size=opts.batch_size,
            ckpt_dir=str(ckpt_dir),
            seed=opts.seed,
            transform=transform,
            progress=ctx.progress,
        )


# ---- the stages, in order ------------------------------------------------------------------------

_SOURCE_KEYS = ("trust_remote_code", "allow_pickle")
_VALIDATION_KEYS = ("device", "dtype", "seq_len", "batch_size")

STAGES: dict[str, Stage] = {
    stage.name: stage
    for stage in (
        Stage(
            "intake",
            needs=(),
            option_keys=_SOURCE_KEYS,
            execute=_intake,
            description="read the checkpoint into a ModelSpec",
            load=_load_spec,
        ),
        Stage(
            "operators",
            needs=(),
            option_keys=(*_SOURCE_KEYS, "profile"),
            execute=_operators,
            description="map every op to a kernel",
            uses=("intake",),  # one anatomy: a model intake cannot read is not mapped as if it were understood
            load=_load_ops_report,
            environment=_operators_environment,  # the target and timings belong to this machine and these libraries
        ),
        Stage(
            "plan",
            needs=("intake",),
            # "machine": a local cluster is measured, so the plan belongs to the machine that measured it
            option_keys=("cluster", "plan_seq_len", "plan_global_batch", "precision", "machine"),
            execute=_plan,
            description="lay the model out on the cluster",
            load=_load_planner_result,
        ),
        Stage(
            "environment",
            needs=(),
            option_keys=("precision", "device", "cluster", "machine"),
            execute=_environment,
            description="check this machine",
            uses=("plan",),
        ),
        Stage(
            "alignment",
            needs=("operators",),
            option_keys=(*_VALIDATION_KEYS, "seed", "thresholds"),
            execute=_alignment,
            description="compare the adapted model with a float64 reference, block by block",
            uses=("intake",),
        ),
        Stage(
            "generation",
            needs=("operators",),
            option_keys=("device", "dtype", "seed", "thresholds"),
            execute=_generation,
            description="generate greedily against the unadapted model: tokens, log-probs, KV cache, left-padded batches",
        ),
        Stage(
            "throughput",
            needs=("operators",),
            option_keys=(*_VALIDATION_KEYS, "bench_steps"),
            execute=_throughput,
            description="measure baseline against adapted",
            load=_load_throughput,
        ),
        Stage(
            "replan",
            needs=("intake", "plan"),
            option_keys=(),
            execute=_replan,
            description="plan again with this machine's measurements",
            uses=("throughput",),
        ),
        Stage(
            "soak",
            needs=("operators",),
            option_keys=(*_VALIDATION_KEYS, "seed", "soak_steps", "ckpt_every"),
            execute=_soak,
            description="train for a while and watch loss, time and memory",
        ),
    )
}
