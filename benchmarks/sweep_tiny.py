"""The tiny-checkpoint builder of ``benchmarks/sweep.py``: any transformers causal LM's default config, shrunk.

Every repair is generic (by a knob's name, its annotation or the error a build raises), never per model, so
that a model type transformers adds tomorrow builds tiny too; the few types whose defaults build at no size are
built from settings stated for them (``sweep_stated``), and each row says which way it was built.  ``build`` runs in a child process of the sweep.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# Small but not degenerate: 4 layers so that hybrid schedules (attention every k-th layer) hold
# more than one layer class, 4 query heads over 2 KV heads, a handful of experts.
TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "embedding_size": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "num_hidden_layers": 4,
    "num_layers": 4,
    "n_layer": 4,
    "n_layers": 4,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    # Group-limited routing (DeepSeek-V3's): the groups must divide the 4 tiny experts, 2 experts each.
    "n_group": 2,
    "num_expert_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "o_lora_rank": 16,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "sliding_window": 16,
    "attention_window": 16,
    "num_global_attention_heads": None,
    # Linear attention (gated delta net, KDA): at its default widths its depthwise conv is 8192 channels wide,
    # which a float64 CPU reference runs group by group (seconds per call).
    "rotary_dim": 8,
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
}


# A size a config leaves unset (None) although a module of the model needs it: filled on a retry when
# the build fails on a None, by the field's name suffix (the longest suffix wins).
FILL_BY_SUFFIX: dict[str, int] = {
    "_head_dim": 16,
    "_heads": 1,
    "_dim": 16,
    "_size": 32,
    "_rank": 16,
    "_budget": 16,
    "_ratio": 4,
}


def _int_fields_unset(config: Any) -> dict[str, int]:
    """Fields annotated as an optional int that hold None, each with the size its name suffix gives."""
    annotations: dict[str, Any] = {}
    for cls in reversed(type(config).__mro__):
        annotations.update(getattr(cls, "__annotations__", {}))
    filled: dict[str, int] = {}
    for name, hint in annotations.items():
        text = hint if isinstance(hint, str) else repr(hint)
        if getattr(config, name, 0) is not None or not re.search(r"\bint\b", text):
            continue
        suffix = max((s for s in FILL_BY_SUFFIX if name.endswith(s)), key=len, default=None)
        if suffix is not None:
            filled[name] = FILL_BY_SUFFIX[suffix]
    return filled


def clamped_token_ids(settings: dict[str, Any], vocab: Any) -> dict[str, Any]:
    """Every ``*_token_id(s)`` in ``settings`` that lies outside a vocabulary of ``vocab``, moved onto its last id."""
    if not isinstance(vocab, int):
        return {}
    clamped: dict[str, Any] = {}
    for name, value in settings.items():
        if not re.fullmatch(r".*_token_ids?", name):
            continue
        if isinstance(value, int) and value >= vocab:
            clamped[name] = vocab - 1
        elif isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
            clamped[name] = [min(v, vocab - 1) if isinstance(v, int) else v for v in value]
    return clamped


DEPTH_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
SCHEDULE_KEYS = ("layer_types", "layers_block_type", "block_types")


def _is_layer_keyed(value: Any) -> bool:
    """Per-layer overrides: settings keyed by layer index (not a label map such as ``id2label``)."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(str(k).isdigit() and isinstance(v, dict) for k, v in value.items())
    )


def kept_layers(settings: dict[str, Any], depth: int, every_kind: bool = True) -> list[int]:
    """Which of the default layers a tiny model keeps: the first layer of each kind (its entry in every schedule and
    its per-layer overrides) in order, then the earliest others, up to ``depth``; without ``every_kind``, the first
    ``depth`` layers.  A hybrid stack keeps every layer class it fits, and a layer keeps its own per-layer settings,
    so settings that must agree across the layers of one kind still do."""
    if not every_kind:
        return list(range(depth))
    before = next(settings[k] for k in DEPTH_KEYS if isinstance(settings.get(k), int))
    schedules = [v for k, v in settings.items() if k in SCHEDULE_KEYS and isinstance(v, list) and len(v) == before]
    overrides = [{int(k): v for k, v in d.items()} for d in settings.values() if _is_layer_keyed(d)]
    kinds = [json.dumps([[s[i] for s in schedules], [o.get(i) for o in overrides]], default=str) for i in range(before)]
    first = [kinds.index(kind) for kind in dict.fromkeys(kinds)][:depth]
    rest = [i for i in range(before) if i not in first][: depth - len(first)]
    return sorted(first + rest)


def per_layer_trimmed(settings: dict[str, Any], depth: int, every_kind: bool = True) -> dict[str, Any]:
    """Per-layer settings cut to ``depth`` layers, the ``kept_layers``: a list with one entry per default layer (a
    schedule too) keeps those layers' entries, a dict keyed by layer index keeps theirs under their new index, and a
    layer count (``num_kv_shared_layers``) at or above the new depth shrinks in proportion.  Without ``every_kind``
    the schedules are left out, for the config to recompute at the new depth."""
    before = next((settings[k] for k in DEPTH_KEYS if isinstance(settings.get(k), int)), None)
    if not before or before <= depth:
        return {}
    kept = kept_layers(settings, depth, every_kind)
    trimmed: dict[str, Any] = {}
    for name, value in settings.items():
        if name in DEPTH_KEYS or (name in SCHEDULE_KEYS and not every_kind):
            continue
        if isinstance(value, list) and len(value) == before:
            trimmed[name] = [value[i] for i in kept]
        elif _is_layer_keyed(value):
            sample = next(iter(value))  # "02": indices written zero-padded, or ints
            by_index = {int(k): v for k, v in value.items()}
            trimmed[name] = {
                new if isinstance(sample, int) else str(new).zfill(len(sample)): by_index[old]
                for new, old in enumerate(kept)
                if old in by_index
            }
        elif name.endswith("_layers") and isinstance(value, int) and not isinstance(value, bool) and value >= depth:
            trimmed[name] = max(1, round(value * depth / before)) if value < before else depth
    return trimmed


def with_depth(config: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with the config's depth under a ``DEPTH_KEYS`` name: a config that aliases its depth
    (BART's ``num_hidden_layers`` reads ``encoder_layers``) has none of them in ``to_dict``, and its other layer
    counts (``decoder_layers``) would then stay at their default while the aliased one shrinks."""
    if any(isinstance(settings.get(k), int) for k in DEPTH_KEYS):
        return settings
    aliased = {k: v for k, v in getattr(config, "attribute_map", {}).items() if k in DEPTH_KEYS}
    depth = next((settings[v] for v in aliased.values() if isinstance(settings.get(v), int)), None)
    return settings if depth is None else {**settings, "num_hidden_layers": depth}


def _has(config: Any, name: str) -> bool:
    """``hasattr`` for a config, where reading a per-layer attribute globally raises something other than an
    AttributeError (transformers' heterogeneous configs): such an attribute exists."""
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001 - the attribute exists, it is only ambiguous across layers
        return True


# The widths of a model's residual streams; a size elsewhere in its configs with the same default (a projector's input,
# an adapter's output into the text tower) is read as tied to one of them and shrinks with it.
HIDDEN_WIDTHS = ("hidden_size", "d_model", "n_embd", "embedding_size")
WIDTH_SUFFIXES = ("_dim", "_size", "_channels", "_width")


def hidden_widths(settings: dict[str, Any]) -> set[int]:
    """The default residual widths of a config and of every config nested in it."""
    widths = {settings[k] for k in HIDDEN_WIDTHS if isinstance(settings.get(k), int) and settings[k] > 1}
    for value in settings.values():
        if isinstance(value, dict):
            widths |= hidden_widths(value)
    return widths


def tied_widths(settings: dict[str, Any], widths: set[int], keep: frozenset[str]) -> dict[str, int]:
    """Sizes not shrunk by name whose default equals a residual width somewhere in the model: shrunk to the tiny
    width, as the width they must match."""
    return {
        name: TINY["hidden_size"]
        for name, value in settings.items()
        if name not in TINY
        and name not in keep
        and name.endswith(WIDTH_SUFFIXES)
        and isinstance(value, int)
        and not isinstance(value, bool)
        and value in widths
    }


def tied_head_counts(settings: dict[str, Any], keep: frozenset[str]) -> dict[str, int]:
    """Head counts under other names (an encoder's, a decoder's, a sliding-window layer's ``*attention_heads``)
    shrunk with the width they divide, and each one's own ``*key_value_heads`` with it: equal to the query heads
    when they were equal by default, else the tiny KV count (a KV count above the query count groups no heads)."""
    heads, kv_heads = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    shrunk: dict[str, int] = {}
    for name, value in settings.items():
        if not name.endswith("attention_heads") or name in TINY or name in keep or not _is_count(value):
            continue
        shrunk[name] = heads
        kv_name = name.removesuffix("attention_heads") + "key_value_heads"
        if kv_name not in TINY and kv_name not in keep and _is_count(settings.get(kv_name)):
            shrunk[kv_name] = heads if settings[kv_name] == value else kv_heads
    return shrunk


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def tied_vocab_sizes(settings: dict[str, Any], vocab: Any, keep: frozenset[str]) -> dict[str, int]:
    """Other vocabulary sizes of a config (``unpadded_vocab_size``, a per-layer input vocabulary) scaled with the
    vocabulary, so that their order against it survives (an unpadded size above the tiny padded one is negative
    padding)."""
    default = settings.get("vocab_size")
    if not isinstance(vocab, int) or not isinstance(default, int) or default <= 0:
        return {}
    return {
        name: max(1, round(value * vocab / default))
        for name, value in settings.items()
        if "vocab" in name and name.endswith("_size") and name not in TINY and name not in keep and _is_count(value)
    }


def _shrunk(entry: dict[str, Any], tiny: dict[str, Any]) -> dict[str, Any]:
    shrunk = {**entry, **{n: tiny[n] for n in entry if tiny.get(n) is not None}}
    return {**shrunk, **_kv_heads_kept(entry, shrunk), **_head_dims_kept(entry, shrunk)}


def _head_dims_kept(default: dict[str, Any], shrunk: dict[str, Any]) -> dict[str, Any]:
    """Head widths equal to ``head_dim`` by default stay equal to it (MLA rotates ``qk_rope_head_dim`` channels with
    rotary tables ``head_dim`` wide): each such group takes the smallest tiny value among them.  Other equal widths
    (an indexer's and a value head's) may coincide by default and are left to shrink on their own."""
    groups: dict[int, list[str]] = {}
    for name, value in default.items():
        if name.endswith("head_dim") and name in shrunk and isinstance(value, int) and not isinstance(value, bool):
            groups.setdefault(value, []).append(name)
    kept: dict[str, Any] = {}
    for names in groups.values():
        sizes = [shrunk[n] for n in names if isinstance(shrunk[n], int)]
        if len(names) > 1 and sizes and "head_dim" in names:
            kept.update(dict.fromkeys(names, min(sizes)))
    return kept


def _kv_heads_kept(default: dict[str, Any], shrunk: dict[str, Any]) -> dict[str, Any]:
    """A config with as many KV heads as query heads (multi-head attention; MLA requires it) keeps them equal."""
    heads, kv = default.get("num_attention_heads"), default.get("num_key_value_heads")
    if isinstance(heads, int) and heads == kv and "num_attention_heads" in shrunk:
        return {"num_key_value_heads": shrunk["num_attention_heads"]}
    return {}


def tiny_settings(
    config: Any,
    keep: frozenset[str],
    fill_unset: bool,
    depth: int,
    widths: set[int] | None = None,
    every_kind: bool = True,
) -> dict[str, Any]:
    """Overrides that shrink one config: every size knob it has, its per-layer settings (their own size knobs too)
    cut to ``depth`` layers, sizes tied to a residual width (``tied_widths``) shrunk with it, its token ids clamped
    into the shrunk vocabulary, and each nested config (a text tower, a vision or audio encoder) shrunk the same way,
    whole.  Knobs in ``keep`` keep their default."""
    from transformers import PretrainedConfig

    settings = config.to_dict()
    widths = hidden_widths(settings) if widths is None else widths
    tiny = {k: v for k, v in TINY.items() if k not in keep}
    overrides = {k: v for k, v in tiny.items() if v is not None and _has(config, k)}
    if "hidden_size" in tiny:
        overrides.update(tied_widths(settings, widths, keep))
        overrides.update(tied_head_counts(settings, keep))
    if fill_unset:
        overrides.update({k: v for k, v in _int_fields_unset(config).items() if k not in keep and k not in overrides})
    overrides.update(tied_vocab_sizes(settings, overrides.get("vocab_size"), keep))
    overrides.update(clamped_token_ids(settings, overrides.get("vocab_size", settings.get("vocab_size"))))
    for name, value in per_layer_trimmed(with_depth(config, settings), depth, every_kind).items():
        if _is_layer_keyed(value):  # per-layer overrides of a size knob shrink like the knob
            value = {k: _shrunk(v, tiny) if isinstance(v, dict) else v for k, v in value.items()}
        overrides.setdefault(name, value)
    overrides.update(_kv_heads_kept(settings, overrides))
    overrides.update(_head_dims_kept(settings, overrides))
    if not every_kind:
        overrides.update({key: None for key in SCHEDULE_KEYS if key in settings})
    for name in settings:
        sub = getattr(config, name, None) if name.endswith("_config") else None
        if isinstance(sub, PretrainedConfig):
            overrides[name] = {**sub.to_dict(), **tiny_settings(sub, keep, fill_unset, depth, widths, every_kind)}
    return overrides


def tiny_config(
    model_type: str,
    keep: frozenset[str] = frozenset(),
    fill_unset: bool = False,
    every_kind: bool = True,
    scaled: frozenset[str] = frozenset(),
) -> Any:
    """The model type's default config with every size knob it has shrunk (but those in ``keep``), nested configs too.

    Token ids land inside the shrunk vocabulary; with ``fill_unset``, optional int sizes left None get a tiny value;
    ``every_kind``: the layers kept hold every layer kind (``kept_layers``), else they are the first ones and the
    config recomputes its schedule (``layer_types``) for the tiny depth; ``scaled``: head counts outside the tiny
    table shrunk with the query heads (``scaled_head_counts``).
    """
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    settings = tiny_settings(default, keep, fill_unset, TINY["num_hidden_layers"], every_kind=every_kind)
    settings.update(scaled_head_counts(default.to_dict(), scaled))
    return AutoConfig.for_model(model_type, **settings)


def scaled_head_counts(settings: dict[str, Any], names: frozenset[str]) -> dict[str, int]:
    """Head counts of other modules (an indexer's ``index_num_heads``) that a config bounds by its query heads:
    scaled by the same factor as the query heads, at least 1."""
    default_heads = settings.get("num_attention_heads")
    if not _is_count(default_heads):
        return {}
    factor = TINY["num_attention_heads"] / default_heads
    return {n: max(1, int(settings[n] * factor)) for n in names if _is_count(settings.get(n))}


def _named_head_counts(err: Exception, settings: dict[str, Any], known: set[str]) -> set[str]:
    """Head counts outside the tiny table that a build error names."""
    text = str(err)
    return {
        k
        for k, v in settings.items()
        if k.endswith("_heads")
        and k not in TINY
        and k not in known
        and _is_count(v)
        and (f"`{k}`" in text or f"'{k}'" in text)
    }


def build(model_type: str, directory: Path) -> None:
    """Build and save one tiny checkpoint (runs in a child process): from the shrunk defaults, else, for the few
    types whose defaults cannot build, from the settings ``sweep_stated`` writes for them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.sweep_stated import STATED_SETTINGS

    settings = "shrunk defaults"
    try:
        model = _tiny(_shrunk_model(model_type))
    except Exception:
        if model_type not in STATED_SETTINGS:
            raise
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **STATED_SETTINGS[model_type]))
        model, settings = _tiny(model), "stated (benchmarks/sweep_stated.py)"
    redraw_untrained_zeros(model)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    print(json.dumps({"params": params, "class": type(model).__name__, "settings": settings}))


def _tiny(model: Any) -> Any:
    params = sum(p.numel() for p in model.parameters())
    if params > 60_000_000:
        raise RuntimeError(f"not tiny: {params:,} parameters")
    return model


def _shrunk_model(model_type: str) -> Any:
    """The model of the type's default config shrunk to ``TINY``, repaired generically where it refuses."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    keep: set[str] = set()
    scaled: set[str] = set()
    fill_unset, every_kind = False, True
    while True:  # a knob the model rejects at this size keeps its default; at most one retry per knob
        torch.manual_seed(0)
        try:
            config = tiny_config(model_type, frozenset(keep), fill_unset, every_kind, frozenset(scaled))
            model = AutoModelForCausalLM.from_config(config)
            break
        except Exception as err:  # the error names the knob, or a size is unset, or the model does not build tiny
            heads = _named_head_counts(err, AutoConfig.for_model(model_type).to_dict(), scaled)
            if heads:  # another module's head count, bounded by the shrunk query heads
                scaled |= heads
                continue
            named = {k for k in TINY if k not in keep and (f"'{k}'" in str(err) or f"`{k}`" in str(err))}
            if not named and not fill_unset and "NoneType" in str(err):
                fill_unset = True
                continue
            if not named and every_kind:  # a stack constrained in order (the layers that share another's KV cache
                every_kind = False  # must find every kind before them), or whose schedule is not one entry a layer
                continue
            if not named:
                raise
            keep |= named
    return model


def redraw_untrained_zeros(model: Any) -> None:
    """A matrix that initialisation leaves all zero (a router trained from zero) ties every choice it makes in a
    random checkpoint, which no trained checkpoint does: it gets a small random draw instead."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and param.is_floating_point() and not param.any():
                param.normal_(0.0, 0.02)
