"""The run directory: one JSON record per stage, written atomically, keyed for reuse.

Layout of ``OUT``::

    OUT/stages/<stage>.json     StageRecord: cache key, status, verdict, summary, raw result
    OUT/stages/<stage>.log      traceback of a stage that raised (only then)
    OUT/artifacts/<stage>/      files a stage wants to keep beside the report (generated kernels, ...)
    OUT/report.{json,md,html}   the report, rebuilt from the stage records after every stage
    OUT/junit.xml

A record is reused when its ``key`` matches: the key hashes the stage name, the options that
affect that stage, the content fingerprint of the source, the keys of the upstream stages, the
adapt version and, for a stage that declares one, its environment (the operators stage: the target
it plans for, the device's name and the torch/triton/transformers versions).  Any change to one of
those recomputes the stage and everything after it.
Edits to adapt's own code inside one version are not detected: pass ``--force`` after them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapt.core.errors import BadInput
from adapt.core.jsonio import atomic_write_json, atomic_write_text, json_default

# Files whose bytes define the model (config, remote code, tokenizer); weights are fingerprinted
# by their safetensors header, size and mtime so that multi-GB shards are never read in full.
_CONTENT_SUFFIXES = (".json", ".py", ".txt", ".model", ".tiktoken", ".yaml", ".jinja")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


def source_fingerprint(root: str | os.PathLike, exclude: str | os.PathLike | None = None) -> str:
    """Content hash of a checkpoint directory (or single file): what a cached stage depends on.

    ``exclude`` is the run's output directory, in case it lies inside the checkpoint directory.
    """
    root = Path(root)
    skip = Path(exclude).resolve() if exclude is not None else None
    digest = hashlib.sha256()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        if skip is not None and path.resolve().is_relative_to(skip):
            continue
        rel = path.name if root.is_file() else path.relative_to(root).as_posix()
        if any(part.startswith(".") for part in Path(rel).parts):
            continue  # .cache/, .git/, editor temp files
        suffix = path.suffix.lower()
        if suffix in _WEIGHT_SUFFIXES:
            stat = path.stat()
            digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
            if suffix == ".safetensors":
                digest.update(_safetensors_header(path))
        elif suffix in _CONTENT_SUFFIXES:
            digest.update(f"{rel}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            return b""
        (length,) = struct.unpack("<Q", prefix)
        return fh.read(min(length, _MAX_SAFETENSORS_HEADER))


def stage_key(
    stage: str,
    options: dict[str, Any],
    fingerprint: str,
    upstream: list[str],
    version: str,
    environment: dict[str, Any] | None = None,
) -> str:
    """``environment``: what else the stage's result depends on (the machine, library versions), if anything."""
    inputs = {"stage": stage, "options": options, "source": fingerprint, "upstream": upstream, "adapt": version}
    if environment is not None:
        inputs["environment"] = environment
    payload = json.dumps(inputs, sort_keys=True, default=json_default)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class StageRecord:
    """What one stage produced, as stored in ``stages/<name>.json`` and copied into report.json."""

    name: str
    status: str  # passed | failed | error | blocked | skipped | interrupted | pending
    verdict: str = ""  # the one-line verdict shown live and in every report
    key: str = ""
    duration_s: float = 0.0
    cached: bool = False
    error: str | None = None
    error_kind: str | None = None  # exception class of an ``error`` status (BadInput -> exit 2)
    summary: dict[str, Any] = field(default_factory=dict)  # normalised view the reports render
    result: dict[str, Any] | None = None  # the stage's own ``to_dict()``, unchanged
    result_type: str | None = None  # "module:Class" of the typed result, for readers (stages rebuild with their loader)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class RunStore:
    """Reads and writes the stage records of one output directory."""

    def __init__(self, out_dir: str | os.PathLike):
        self.root = Path(out_dir)
        self.stages_dir = self.root / "stages"

    def artifacts(self, stage: str) -> Path:
        path = self.root / "artifacts" / stage
        path.mkdir(parents=True, exist_ok=True)
        return path

    def load(self, stage: str) -> StageRecord | None:
        path = self.stages_dir / f"{stage}.json"
        if not path.exists():
            return None
        try:
            return StageRecord.from_dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError):
            return None  # an unreadable record is simply recomputed

    def save(self, record: StageRecord) -> None:
        atomic_write_json(self.stages_dir / f"{record.name}.json", record.to_dict())

    def save_log(self, stage: str, text: str) -> Path:
        return atomic_write_text(self.stages_dir / f"{stage}.log", text)

    def clear_log(self, stage: str) -> None:
        (self.stages_dir / f"{stage}.log").unlink(missing_ok=True)


class RunLock:
    """An exclusive lock on a run directory: a second run on the same ``--out`` refuses at once.

    ``flock`` on ``OUT/.lock`` is released by the kernel when the process ends, however it ends, so a
    killed run never leaves a stale lock behind.  The file holds the owner's pid for the message.
    """

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / ".lock"
        self._fh: Any = None

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # no flock on this platform: runs are not serialised
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fh = self.path.open("a+")
        except OSError as err:
            raise BadInput(f"--out {self.path.parent}: cannot write there ({err.strerror or err})") from None
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            owner = fh.read().strip() or "unknown"
            fh.close()
            raise BadInput(
                f"--out {self.path.parent}: another adapt run (pid {owner}) is using this directory; "
                "wait for it to finish or choose another --out"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # closing drops the flock
            self._fh = None

    def __enter__(self) -> RunLock:  # noqa: PYI034 - a final class
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
