"""Runs the stages in order, reusing stored results, and writes the report after every stage.

A stage's typed result is rebuilt from its stored ``to_dict()`` (the stage's ``load``) only when
a later stage actually needs it; a cached run therefore loads nothing at all.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapt.app.pipeline.options import STAGE_NAMES, DeviceDescription, RunOptions, max_positions
from adapt.app.pipeline.preflight import (
    check_options,
    check_source_config,
    check_validation_shape,
    plan_seq_len_notes,
)
from adapt.app.pipeline.progress import RunProgress
from adapt.app.pipeline.stages import (
    STAGES,
    Stage,
    StageBlocked,
    StageContext,
    StageUnavailable,
    summarise,
    summary_context,
    to_result_dict,
)
from adapt.app.pipeline.store import RunLock, RunStore, StageRecord, source_fingerprint, stage_key
from adapt.core.errors import BadInput, ModelCannotRun
from adapt.core.interrupts import Terminated, deferred_interrupts
from adapt.core.jsonio import adapt_version, atomic_write_json, to_jsonable
from adapt.core.stage_verdicts import STAGE_CHECKS, SummaryContext, judged

REUSABLE = ("passed", "failed")  # statuses whose stored result can stand in for a rerun
NOT_AVAILABLE = ("error", "blocked", "interrupted", "skipped", "pending")


@dataclass
class SourceInfo:
    text: str
    path: str
    fingerprint: str
    handle: Any  # adapt.core.source.ModelSource

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "path": self.path, "fingerprint": self.fingerprint}


@dataclass
class RunOutcome:
    records: dict[str, StageRecord]
    report: dict[str, Any]
    exit_code: int
    out_dir: Path


def resolve(options: RunOptions) -> SourceInfo:
    """Resolve the source (hub id, directory or config.json) and fingerprint its files; imports no torch."""
    from adapt.core.source import resolve_source

    model = options.model
    handle = resolve_source(model.source, trust_remote_code=model.trust_remote_code, allow_pickle=model.allow_pickle)
    path = Path(_local_path(handle))
    return SourceInfo(model.source, str(path), source_fingerprint(path, exclude=options.run.out_dir), handle)


def _local_path(handle: Any) -> str:
    """What to fingerprint: the checkpoint directory, or only the file for a bare config.json source."""
    if getattr(handle, "kind", None) == "config":
        return str(handle.config_path)  # its directory may hold anything at all
    root = getattr(handle, "root", None)  # ModelSource.root: the directory holding config.json
    if not root:
        raise BadInput(f"intake resolved {handle!r} to no local directory")
    return str(root)


class PipelineRun:
    def __init__(self, options: RunOptions, progress: RunProgress):
        self.options = options
        self.progress = progress
        self.store = RunStore(options.run.out_dir)
        self.source: SourceInfo | None = None
        self.records: dict[str, StageRecord] = {name: StageRecord(name, "pending") for name in STAGE_NAMES}
        self.keys: dict[str, str] = {}
        self.typed: dict[str, Any] = {}
        self.rebuilt: list[str] = []  # cached stages re-executed because their result type has no from_dict
        self.preflight_notes: dict[str, list[str]] = {}  # what the input checks changed, per stage
        self._summary_context: SummaryContext | None = None
        self.refused_by: str | None = None  # the stage that found the model cannot run: no later stage runs

    def summary_context(self) -> SummaryContext:
        """Built once the options have their device defaults: the facts summaries state, the thresholds they use."""
        if self._summary_context is None:
            self._summary_context = summary_context(self.options)
        return self._summary_context

    # ---- upstream typed results ------------------------------------------------------------
    def upstream(self, name: str) -> Any:
        if name in self.typed:
            return self.typed[name]
        record = self.records[name]
        if record.status not in REUSABLE or record.result is None:
            raise StageBlocked(f"needs the {name} result, which is {record.status}")
        self.typed[name] = self._rebuild(STAGES[name], record)
        return self.typed[name]

    def optional_upstream(self, name: str) -> Any:
        if name not in self.options.run.stages or self.records[name].status not in REUSABLE:
            return None
        return self.upstream(name)

    def _rebuild(self, stage: Stage, record: StageRecord) -> Any:
        if stage.load is not None:
            return stage.load(record.result)
        # No way back from JSON: recompute (same key, so the same result) without touching the record.
        self.rebuilt.append(stage.name)
        return stage.run(self._context(stage))

    def _context(self, stage: Stage, progress=lambda *a: None) -> StageContext:
        return StageContext(
            options=self.options,
            source=self.source.handle,
            artifacts=self.store.artifacts(stage.name),
            progress=progress,
            key=self.keys.get(stage.name, ""),
            upstream=self.upstream,
            optional_upstream=self.optional_upstream,
        )

    # ---- one stage ---------------------------------------------------------------------------
    def run_stage(self, stage: Stage) -> StageRecord:
        opts = self.options
        if stage.name not in opts.run.stages:
            return StageRecord(stage.name, "skipped", "not selected (--stages/--skip)")
        if self.refused_by is not None:
            return StageRecord(stage.name, "blocked", f"the {self.refused_by} stage found that the model cannot run")
        for need in stage.needs:
            if need not in opts.run.stages:
                return StageRecord(stage.name, "blocked", f"needs the {need} stage, which is not selected")
            if self.records[need].status in NOT_AVAILABLE:
                return StageRecord(
                    stage.name, "blocked", f"needs the {need} result, which is {self.records[need].status}"
                )
        for use in stage.uses:  # an optional upstream that ran and errored stops this stage too
            if use in opts.run.stages and self.records[use].status == "error":
                return StageRecord(stage.name, "blocked", f"the {use} stage it reads ended in an error")
        upstream = [self.keys[n] for n in (*stage.needs, *stage.uses) if n in self.keys and n in opts.run.stages]
        key = stage_key(
            stage.name,
            opts.subset(stage.option_keys),
            self.source.fingerprint,
            upstream,
            adapt_version(),
            stage.key_environment(),
        )
        self.keys[stage.name] = key
        stored = self.store.load(stage.name)
        if stored is not None and stored.key == key and stored.status in REUSABLE and not opts.run.force:
            stored.cached = True
            section = self.summary_context().section(stage.name)
            if section is not None:  # the stored summary, judged by this run's thresholds
                stored.status = "passed" if judged(STAGE_CHECKS[stage.name](stored.summary, section)) else "failed"
            return stored
        return self._execute(stage, key)

    def _execute(self, stage: Stage, key: str) -> StageRecord:
        start = time.perf_counter()
        record = StageRecord(stage.name, "error", key=key)
        self.store.clear_log(stage.name)
        self.rebuilt.clear()
        _reset_compile_caches()
        saved = TorchGlobals.capture()
        try:
            with self.progress.stage(stage.name, stage.description) as callback:
                ctx = self._context(stage, callback)
                result = stage.run(ctx)
            raw = record.result = to_jsonable(to_result_dict(result))
            record.result_type = f"{type(result).__module__}:{type(result).__qualname__}"
            summary = summarise(result, self.summary_context())
            record.status = "passed" if summary.passed else "failed"
            record.verdict = summary.verdict
            rebuilt = [f"re-ran the cached {n} stage to rebuild its typed result (time included)" for n in self.rebuilt]
            preflight = self.preflight_notes.get(stage.name, [])
            notes = [
                *preflight,
                *ctx.notes,
                *rebuilt,
                *(raw.get("notes") or []),
            ]  # the pipeline's notes, then the stage's own
            data = to_jsonable(summary.data)
            record.summary = {**data, "notes": notes} if notes else data
            self.typed[stage.name] = result
        except KeyboardInterrupt:
            record.status, record.verdict = "interrupted", "interrupted by the user"
            raise
        except StageBlocked as err:
            record.status, record.verdict = "blocked", str(err)
        except StageUnavailable as err:
            record.error, record.error_kind = str(err), "StageUnavailable"
            record.verdict = f"stage unavailable: {err}"
        except Exception as err:  # noqa: BLE001 - a failing stage must not lose the others' results
            kind = "BadInput" if isinstance(err, BadInput) else type(err).__name__  # its kinds read as one
            record.error, record.error_kind = f"{kind}: {err}", kind
            record.verdict = _first_line(record.error)
            if isinstance(err, ModelCannotRun):
                self.refused_by = stage.name
            self.store.save_log(stage.name, traceback.format_exc())
        finally:
            saved.restore()  # e.g. the soak's deterministic mode must not leak into the next stage or run
            record.duration_s = round(time.perf_counter() - start, 3)
        return record

    # ---- the whole run -------------------------------------------------------------------------
    def run(self) -> RunOutcome:
        """Check every input, lock the run directory, then run the stages; reports survive Ctrl-C/SIGTERM."""
        check_options(self.options)  # before anything is read, written or imported
        self.source = resolve(self.options)
        device = DeviceDescription.of(self.options.validation.device)
        positions = max_positions(getattr(self.source.handle, "config_dict", {}))
        self.options = self.options.with_device_defaults(device, positions)
        check_source_config(self.source.handle)
        config = getattr(self.source.handle, "config_dict", None) or {}
        check_validation_shape(self.options.validation, self.options.run.stages, positions, config)
        self.preflight_notes["plan"] = plan_seq_len_notes(self.options.plan, self.source.handle)
        with RunLock(self.options.run.out_dir):
            return self._run_stages()

    def _run_stages(self) -> RunOutcome:
        from reports import build_report, write_reports
        from reports.tables import PLAN_FILE

        name = STAGE_NAMES[0]
        try:
            for name in STAGE_NAMES:
                record = self.records[name] = self.run_stage(STAGES[name])
                self.progress.verdict(name, record.status, record.verdict, record.duration_s, record.cached)
                with deferred_interrupts():  # a record and its report are written whole or not at all
                    if not record.cached and record.status not in ("skipped", "blocked"):
                        self.store.save(record)  # never overwrite a stored result with "did not run this time"
                    if name == "plan" and record.status == "passed" and record.result:
                        # what launch reads
                        atomic_write_json(Path(self.options.run.out_dir) / PLAN_FILE, record.result)
                    write_reports(self._report(build_report), self.options.run.out_dir, formats=("json",))
        except KeyboardInterrupt as interrupt:
            if self.records[name].status == "pending":  # the stage that was running
                signal_name = "SIGTERM" if isinstance(interrupt, Terminated) else "Ctrl-C"
                self.records[name].status = "interrupted"
                self.records[name].verdict = f"interrupted ({signal_name})"
            with deferred_interrupts():
                write_reports(self._report(build_report), self.options.run.out_dir)
            raise
        report = self._report(build_report)
        with deferred_interrupts():
            write_reports(report, self.options.run.out_dir)
        return RunOutcome(self.records, report, exit_code_of(self.records), Path(self.options.run.out_dir))

    def _report(self, build_report) -> dict[str, Any]:
        return build_report(
            records=[self.records[n] for n in STAGE_NAMES],
            options=self.options.to_dict(),
            source=self.source.to_dict(),
        )


def exit_code_of(records: dict[str, StageRecord]) -> int:
    """0 every stage passed, 1 a stage or check failed, 2 a stage rejected its input."""
    from reports.schema import exit_code_for

    return exit_code_for([r.to_dict() for r in records.values()])


def run_pipeline(options: RunOptions, progress: RunProgress | None = None) -> RunOutcome:
    """Run (or resume) the pipeline for ``options``; reports land in ``options.run.out_dir``."""
    progress = progress or RunProgress(quiet=True)
    with progress:
        return PipelineRun(options, progress).run()


@dataclass
class TorchGlobals:
    """Process-wide torch settings a stage may change; restored after it so stages stay independent."""

    values: dict[str, Any]

    @classmethod
    def capture(cls) -> TorchGlobals:
        torch = sys.modules.get("torch")
        if torch is None:
            return cls({})
        return cls(
            {
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                "default_dtype": torch.get_default_dtype(),
                "grad_enabled": torch.is_grad_enabled(),
                "num_threads": torch.get_num_threads(),
                "float32_matmul_precision": torch.get_float32_matmul_precision(),
                "cudnn_deterministic": torch.backends.cudnn.deterministic,
                "cudnn_benchmark": torch.backends.cudnn.benchmark,
                "process_group": torch.distributed.is_available() and torch.distributed.is_initialized(),
            }
        )

    def restore(self) -> None:
        if not self.values:
            return
        import torch

        v = self.values
        torch.use_deterministic_algorithms(v["deterministic"], warn_only=v["deterministic_warn_only"])
        torch.set_default_dtype(v["default_dtype"])
        torch.set_grad_enabled(v["grad_enabled"])
        torch.set_num_threads(v["num_threads"])
        torch.set_float32_matmul_precision(v["float32_matmul_precision"])
        torch.backends.cudnn.deterministic = v["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = v["cudnn_benchmark"]
        if not v["process_group"] and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # the one-rank group bench/soak made for themselves


def _reset_compile_caches() -> None:
    """Each stage starts with clean torch.compile caches, as it would in a fresh process.

    Otherwise recompilations counted in one stage (e.g. throughput's decode shapes) exhaust the
    recompile limit of a generated kernel before the next stage calls it.
    """
    if "torch" in sys.modules:  # a run whose stages never imported torch has nothing to reset
        sys.modules["torch"].compiler.reset()


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text
