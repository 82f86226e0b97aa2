"""JSON I/O every layer shares: atomic writes (readers see the old file or the new one, never half), one encoder for
the values results carry (dataclasses, paths, tensors' scalars), and the adapt version that results are stamped with."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never half."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; a report is as readable as any file the user writes
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=json_default) + "\n")


def json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def to_jsonable(value: Any) -> Any:
    """Round-trip through JSON so a stored result is exactly what a later run will read back."""
    return json.loads(json.dumps(value, default=json_default))


def adapt_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("adapt")
    except PackageNotFoundError:
        return "unknown"
