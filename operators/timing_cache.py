"""An on-disk cache for measurements that depend only on code, shapes and the machine, never on weights.

Kernel timings and kernel self-tests cost seconds each and give the same answer on every run of the same
software on the same device, so they are kept across runs.  A key holds what the caller measured
(kernel, variant, shape, dtype) plus ``environment()``: the device name and the torch, triton,
transformers and adapt versions, so an upgrade or another GPU measures again.  The directory is
``$ADAPT_CACHE``, else ``$XDG_CACHE_HOME/adapt``, else ``~/.cache/adapt``.  Writes go to a temporary
file renamed over the old one, merged with what is on disk at that moment, so concurrent runs never
leave a torn file and rarely lose an entry; an unreadable file counts as empty.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import torch


def cache_dir() -> Path:
    if os.environ.get("ADAPT_CACHE"):
        return Path(os.environ["ADAPT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "adapt"


def package_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def library_versions() -> dict[str, str | None]:
    return {
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "transformers": package_version("transformers"),
        "adapt": package_version("adapt"),
    }


def device_label(device: str) -> str:
    """The device's marketing name (CUDA) or ``cpu``: timings move with the part, not with its index."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return device


def environment(device: str) -> dict[str, Any]:
    return {"device": device_label(device), **library_versions()}


def make_key(device: str, *parts: Any) -> str:
    payload = json.dumps([environment(device), *parts], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


class DiskCache:
    """One JSON file of ``key -> value`` under ``cache_dir()``; values must be JSON-serialisable."""

    def __init__(self, name: str):
        self.path = cache_dir() / f"{name}.json"

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> Any:
        return self._read().get(key)

    def put(self, key: str, value: Any) -> None:
        """Merge ``key`` into the file as it is now and replace it atomically; a read-only cache is skipped."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            data = self._read()
            data[key] = value
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.stem}-", suffix=".tmp")
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            return


def source_digest(*directories: str | Path) -> str:
    """A digest of every ``.py`` file under ``directories``: a kernel edited in place is tested again."""
    h = hashlib.sha256()
    for directory in directories:
        for path in sorted(Path(directory).rglob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def adapt_code_digest() -> str:
    """adapt's own code (``operators`` and ``adapt``): a result that depends on it is measured again after an edit."""
    root = Path(__file__).resolve().parents[1]
    return source_digest(root / "operators", root / "adapt")
