"""Reading the files a user hands adapt, and checks of a model's ``config.json`` that every command shares, so
bad content fails as bad input.

Two layers: adapt's own checks of the sizes every decoder needs (cheap, no imports, run when the
source is resolved), and transformers' own validation of the config class (``check_with_transformers``,
run when work starts, because importing transformers costs seconds).  Either raises ``BadInput``
with one line naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
import os
from typing import Any

from adapt.core.errors import BadInput

# Sizes every decoder config states, each of which must be a positive integer.
_POSITIVE_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "max_position_embeddings",
    "head_dim",
    "num_key_value_heads",
)
# A skeleton costs milliseconds a layer to build and describe (4000 tiny layers: 17 s on the build machine); the
# deepest published decoders have a few hundred.  Past this a config is a typo, not a model.
MAX_LAYERS = 10_000
# Other count- or size-like keys: zero may mean "none" (no shared experts, no dense layers), negative never.
_SIZE_PREFIXES = ("num_", "n_")
_SIZE_SUFFIXES = ("_size", "_dim", "_heads", "_experts", "_layers", "_rank")
# Keys of configs that nest the decoder's own config (multimodal wrappers).
_NESTED = ("text_config", "language_config", "llm_config")


def read_input_text(path: str | os.PathLike, what: str = "") -> str:
    """The text of a file the user named (config, cluster, plan, profile, thresholds, calibration, report): one
    ``BadInput`` line when it cannot be read or is not UTF-8 text, whatever the reader does with it next."""
    where = f"{what} {os.fspath(path)}" if what else os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as err:
        raise BadInput(f"{where}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start})") from None
    except OSError as err:
        raise BadInput(f"{where}: cannot read ({err.strerror or err})") from None


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _size_like(key: str) -> bool:
    return key.startswith(_SIZE_PREFIXES) or key.endswith(_SIZE_SUFFIXES)


def check_config_values(config: dict[str, Any], where: str) -> None:
    """adapt's own checks: no NaN anywhere, positive sizes, no negative counts, heads that divide the width,
    a positive finite rotary base."""
    _check_no_nan(config, where, "")
    _check_level(config, where)
    for key in _NESTED:
        nested = config.get(key)
        if isinstance(nested, dict):
            _check_level(nested, f"{where} {key}")


def _check_no_nan(value: Any, where: str, path: str) -> None:
    """NaN is never a setting (Python's JSON reader accepts the bare word): it would reach the weights' maths."""
    if isinstance(value, float) and math.isnan(value):
        raise BadInput(f"{where}: {path} is NaN; allowed: a number")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_no_nan(item, where, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_no_nan(item, where, f"{path}[{index}]")


def _check_level(config: dict[str, Any], where: str) -> None:
    for key in _POSITIVE_SIZES:
        value = config.get(key)
        if value is None:
            continue
        per_layer = value if isinstance(value, list) and value else [value]  # Gemma 3n: one size per layer
        if not all(_is_whole(v) and v >= 1 for v in per_layer):
            raise BadInput(f"{where}: {key} is {value!r}; allowed: an integer >= 1, or a list of them (one per layer)")
    layers = config.get("num_hidden_layers")
    if _is_whole(layers) and layers > MAX_LAYERS:
        raise BadInput(f"{where}: num_hidden_layers is {layers}; allowed: up to {MAX_LAYERS:,} (a typo, not a model)")
    for key, value in config.items():
        if key in _POSITIVE_SIZES or not _size_like(key):
            continue
        if _is_whole(value) and value < 0 or isinstance(value, float) and (not math.isfinite(value) or value < 0):
            raise BadInput(f"{where}: {key} is {value!r}; allowed: a number >= 0")
    for holder in (config, config.get("rope_parameters"), config.get("rope_scaling")):
        theta = holder.get("rope_theta") if isinstance(holder, dict) else None
        if isinstance(theta, (int, float)) and not isinstance(theta, bool) and not (math.isfinite(theta) and theta > 0):
            raise BadInput(f"{where}: rope_theta is {theta!r}; allowed: a finite number > 0 (the rotary base)")
    hidden, heads, kv = config.get("hidden_size"), config.get("num_attention_heads"), config.get("num_key_value_heads")
    if hidden and heads and config.get("head_dim") is None and hidden % heads:
        raise BadInput(
            f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
            "allowed: a head count that divides the width, or an explicit head_dim"
        )
    if heads and kv and heads % kv:
        raise BadInput(f"{where}: num_key_value_heads is {kv}; allowed: a divisor of num_attention_heads ({heads})")


def check_with_transformers(config: dict[str, Any], where: str) -> None:
    """transformers' own validation of the config class; its errors are the user's input, not a bug.

    Configs with remote code or a model type transformers does not know are left to intake, which
    reports those with their own message.
    """
    model_type = config.get("model_type")
    if config.get("auto_map") or not isinstance(model_type, str):
        return
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return
    try:
        CONFIG_MAPPING[model_type].from_dict(dict(config))
    except Exception as err:  # noqa: BLE001 - any rejection by the config class is a bad value in the file
        raise BadInput(f"{where}: transformers rejects this {model_type} config: {config_error_line(err)}") from None


def config_error_line(err: BaseException) -> str:
    """The reason inside transformers' (possibly wrapped, multi-line) validation error, on one line."""
    cause = err
    while cause.__cause__ is not None and cause.__cause__ is not cause:
        cause = cause.__cause__
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    text = lines[-1] if lines else type(cause).__name__
    return text[:300]


def is_config_validation_error(err: BaseException) -> bool:
    """transformers' strict-dataclass validation errors (raised from config classes)."""
    return type(err).__name__ in ("StrictDataclassClassValidationError", "StrictDataclassFieldValidationError")
