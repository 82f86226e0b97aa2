"""Resolve what the user pointed at (hub id, directory, bare config.json) into a ``ModelSource``.

Nothing here loads a tensor or runs model code: it finds files, validates that ``config.json``
parses, refuses remote code without ``--trust-remote-code`` and pickled weights without
``--allow-pickle``, and computes a content hash that later stages use as a cache key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from adapt.core.errors import BadInput
from adapt.core.inputs import check_config_values, read_input_text

SourceKind = Literal["hub", "directory", "config"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-/]+)?$")


@dataclass
class ModelSource:
    """Where a checkpoint lives and which files make it up."""

    text: str  # what the user typed
    kind: SourceKind
    root: str  # directory holding config.json
    config_path: str
    weight_format: Literal["safetensors", "pytorch_bin", "none"]
    weight_files: list[str] = field(default_factory=list)
    index_file: str | None = None
    hub_id: str | None = None
    revision: str | None = None
    config_only: bool = False
    trust_remote_code: bool = False
    allow_pickle: bool = False
    config_dict: dict[str, Any] = field(default_factory=dict)

    @property
    def has_weights(self) -> bool:
        return not self.config_only and bool(self.weight_files)

    def content_hash(self) -> str:
        """Hash of config + weight file names, sizes and safetensors headers (cheap; no tensor data)."""
        digest = hashlib.sha256()
        digest.update(json.dumps(self.config_dict, sort_keys=True).encode())
        digest.update(f"config_only={self.config_only}".encode())
        for path in sorted(self.weight_files):
            stat = os.stat(path)
            digest.update(f"{os.path.basename(path)}:{stat.st_size}".encode())
            if path.endswith(".safetensors") and stat.st_size >= 8:
                with open(path, "rb") as fh:
                    head = fh.read(8)
                    size = int.from_bytes(head, "little")
                    digest.update(fh.read(min(size, 64 << 20)))
        for extra in sorted(Path(self.root).glob("*.py")):
            digest.update(extra.read_bytes())
        return digest.hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("config_dict")
        return data


def resolve_source(
    text: str,
    *,
    config_only: bool = False,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    revision: str | None = None,
) -> ModelSource:
    """Find the checkpoint named by ``text`` and check that it is usable, without loading it."""
    path = Path(text).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix != ".json":
                raise BadInput(f"{text}: expected a checkpoint directory or a config.json file")
            root, config_path, kind = path.parent, path, "config"
            config_only = True
        else:
            root, config_path, kind = path, path / "config.json", "directory"
            if not config_path.is_file():
                raise BadInput(f"{text}: no config.json in this directory")
        hub_id = None
    elif _HUB_ID.match(text) and not text.startswith((".", "/", "~")):
        hub_id, _, rev = text.partition("@")
        revision = rev or revision
        root = _resolve_hub(hub_id, revision, config_only)
        config_path, kind = root / "config.json", "hub"
    else:
        raise BadInput(f"{text}: no such file or directory, and not a Hugging Face id of the form org/name[@revision]")

    config_dict = _read_config(config_path)
    check_config_values(config_dict, str(config_path))
    _check_remote_code(config_dict, root, trust_remote_code)

    weight_format, weight_files, index_file = "none", [], None
    if not config_only:
        weight_format, weight_files, index_file = _find_weights(root, allow_pickle)

    return ModelSource(
        text=text,
        kind=kind,  # type: ignore[arg-type]
        root=str(root),
        config_path=str(config_path),
        weight_format=weight_format,  # type: ignore[arg-type]
        weight_files=[str(p) for p in weight_files],
        index_file=str(index_file) if index_file else None,
        hub_id=hub_id,
        revision=revision,
        config_only=config_only or weight_format == "none",
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
        config_dict=config_dict,
    )


def _read_config(config_path: Path) -> dict[str, Any]:
    text = read_input_text(config_path)
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as err:
        raise BadInput(f"{config_path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    except _DuplicateKey as err:
        raise BadInput(
            f"{config_path}: key {err.args[0]!r} appears twice in one object; allowed: each key once"
        ) from None
    if not isinstance(data, dict):
        raise BadInput(f"{config_path}: expected a JSON object")
    return data


# transformers writes a float JSON cannot hold (inf, -inf, nan) as {"__float__": "Infinity"} and reads it back as the
# float (``PretrainedConfig._encode_special_floats``): a config it saved is read here as it reads it.
_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


class _DuplicateKey(ValueError):
    """A JSON object that names a key twice: readers disagree on which value wins (Python's takes the last)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> Any:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return _special_float(obj)


def _special_float(obj: dict[str, Any]) -> Any:
    tag = obj.get("__float__") if len(obj) == 1 else None
    return _SPECIAL_FLOATS[tag] if isinstance(tag, str) and tag in _SPECIAL_FLOATS else obj


def _check_remote_code(config: dict[str, Any], root: Path, trust_remote_code: bool) -> None:
    auto_map = config.get("auto_map")
    if not auto_map or trust_remote_code:
        return
    # Name what would run: the model class (preferred) and the file it lives in.
    preferred = [k for k in auto_map if "CausalLM" in k] + [k for k in auto_map if k != "AutoConfig"] + list(auto_map)
    ref = auto_map[preferred[0]]
    ref = ref[0] if isinstance(ref, list) else ref
    repo, _, ref_local = ref.rpartition("--")
    module, _, cls = ref_local.rpartition(".")
    file = (f"{repo}:" if repo else "") + str(root / f"{module}.py")
    raise BadInput(
        f"this checkpoint ships its own model code ({cls} in {file}); it is not run without --trust-remote-code"
    )


def _find_weights(root: Path, allow_pickle: bool) -> tuple[str, list[Path], Path | None]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(read_input_text(index))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise BadInput(f"{index}: not a valid safetensors index ({err})") from None
        files = sorted({root / name for name in weight_map.values()})
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise BadInput(f"{index}: shards listed but not present: {', '.join(missing[:5])}")
        return "safetensors", files, index
    shards = sorted(root.glob("*.safetensors"))
    if shards:
        return "safetensors", shards, None
    pickles = sorted(root.glob("pytorch_model*.bin")) + sorted(root.glob("*.pt")) + sorted(root.glob("*.pth"))
    if pickles:
        if not allow_pickle:
            raise BadInput(
                f"{root}: only pickled weights ({pickles[0].name}); pickle can execute code, so they are refused "
                "unless --allow-pickle is given (they then load with weights_only=True)"
            )
        return "pytorch_bin", pickles, None
    return "none", [], None


def _resolve_hub(hub_id: str, revision: str | None, config_only: bool) -> Path:
    """Resolve a hub id through the huggingface_hub cache; download only when online."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE)
    patterns = ["config.json", "*.py"] + ([] if config_only else ["*.safetensors", "*.safetensors.index.json"])
    try:
        return Path(snapshot_download(hub_id, revision=revision, allow_patterns=patterns, local_files_only=offline))
    except LocalEntryNotFoundError:
        where = f"{hub_id}@{revision}" if revision else hub_id
        if offline:
            raise BadInput(
                f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 forbids downloading it"
            ) from None
        raise BadInput(f"{where}: could not be downloaded or found in the cache") from None
    except Exception as err:  # repository not found, gated, network errors
        raise BadInput(f"{hub_id}: {type(err).__name__}: {str(err).splitlines()[0]}") from None
