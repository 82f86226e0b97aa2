"""Build models through transformers' own classes: on the meta device for structure, or with real weights.

The model class is chosen the way transformers itself would: the checkpoint's declared
``architectures`` (or its ``auto_map`` with ``--trust-remote-code``), resolved through the
Auto mappings.  Decoders get their causal-LM class; encoders get their base model.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from adapt.core.checkpoint import cross_check, read_checkpoint
from adapt.core.errors import BadInput
from adapt.core.source import ModelSource
from adapt.core.spec import CheckpointReport


@contextlib.contextmanager
def quiet_transformers():
    """transformers logs advice about configs and generation on stdout/stderr; keep our output clean."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" would share stderr with a refusal's one line
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                yield
            finally:
                hf_logging.set_verbosity(previous)
                if bars:
                    hf_logging.enable_progress_bar()


def load_config(src: ModelSource):
    """The transformers config object; an unknown architecture is bad input, not a traceback."""
    from transformers import AutoConfig

    model_type = src.config_dict.get("model_type")
    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(src.root, trust_remote_code=src.trust_remote_code)
    except (ValueError, KeyError) as err:
        import transformers

        if src.config_dict.get("auto_map"):
            raise BadInput(f"{src.config_path}: the checkpoint's own config code failed: {_first_line(err)}") from None
        raise BadInput(
            f"{src.config_path}: unknown architecture model_type={model_type!r}: transformers "
            f"{transformers.__version__} does not know it and the checkpoint ships no model code (auto_map)"
        ) from None
    except OSError as err:
        raise BadInput(f"{src.config_path}: {_first_line(err)}") from None
    keep_attention_faithful(config)
    return config


def declared_attention_softcap(config: Any) -> float | None:
    """The attention logit soft-cap ``c`` of ``c * tanh(scores / c)`` a (text) config declares, if any."""
    cap = getattr(config, "attn_logit_softcapping", None)
    return float(cap) if cap else None


def keep_attention_faithful(config: Any) -> None:
    """Ask for transformers' ``eager`` attention where a config caps attention logits and SDPA would serve it.

    torch's SDPA has no score modification, so transformers' ``sdpa`` path silently drops a configured cap
    (transformers 5.17 serves Gemma-2 through it; 5.25 refuses SDPA for it).  The model adapt loads must compute
    the function its config declares: the reference, the trace the operators read, and every baseline; adapt's
    own attention kernel applies the cap afterwards.  An implementation the config already names that can apply
    a cap (eager, flash, flex) is kept.
    """
    configs = [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {})]
    capped = any(c is not None and declared_attention_softcap(c) for c in configs)
    if capped and getattr(config, "_attn_implementation", None) in (None, "sdpa"):
        config._attn_implementation = "eager"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def model_class(src: ModelSource, config):
    """The transformers class to instantiate: causal LM for decoders, the base model for encoders."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    auto_map = src.config_dict.get("auto_map") or {}
    if auto_map:
        return AutoModelForCausalLM if "AutoModelForCausalLM" in auto_map else AutoModel
    declared = list(getattr(config, "architectures", None) or [])
    try:
        causal_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        causal_cls = None
    if causal_cls is None:
        try:
            MODEL_MAPPING[type(config)]
        except KeyError:
            declared_cls = _declared_class(declared, config)
            if declared_cls is None:
                raise BadInput(
                    f"{src.config_path}: transformers has no model class for {type(config).__name__}"
                ) from None
            return declared_cls
        return AutoModel
    if declared and causal_cls.__name__ not in declared:
        # The checkpoint declares a non-causal class (e.g. an encoder's base model).
        import transformers

        declared_cls = getattr(transformers, declared[0], None)
        if declared_cls is not None and declared_cls is not causal_cls:
            return AutoModel
    return AutoModelForCausalLM


class DeclaredClass:
    """A class the checkpoint names in ``architectures`` when no Auto mapping lists its config class (a
    multimodal model's text tower saved on its own): built and loaded as ``Class.from_pretrained`` would,
    behind the Auto classes' two entry points."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def from_config(self, config: Any, trust_remote_code: bool = False, **kwargs: Any) -> nn.Module:
        return self.cls._from_config(config, **kwargs)

    def from_pretrained(self, path: Any, trust_remote_code: bool = False, **kwargs: Any) -> nn.Module:
        return self.cls.from_pretrained(path, **kwargs)


def _declared_class(declared: list[str], config: Any) -> DeclaredClass | None:
    """The first declared transformers class whose config class is exactly ``config``'s."""
    import transformers

    for name in declared:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and getattr(cls, "config_class", None) is type(config):
            return DeclaredClass(cls)
    return None


def build_meta_model(src: ModelSource, config=None) -> torch.nn.Module:
    """The full model on the meta device: real module tree and shapes, no memory for weights."""
    config = config if config is not None else load_config(src)
    cls = model_class(src, config)
    dtype = _config_dtype(config)
    try:
        with quiet_transformers(), torch.device("meta"):
            return cls.from_config(config, trust_remote_code=src.trust_remote_code, dtype=dtype)
    except BadInput:
        raise
    except Exception as err:
        raise BadInput(f"{src.config_path}: transformers could not build the model: {_first_line(err)}") from None


def _config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def check_checkpoint(src: ModelSource, model: nn.Module) -> CheckpointReport | None:
    """Cross-check safetensors headers against the skeleton; shape mismatches are bad input."""
    if src.config_only or not src.weight_files:
        return None
    if src.weight_format != "safetensors":
        return CheckpointReport(format="pytorch_bin", files=[f.rsplit("/", 1)[-1] for f in src.weight_files])
    tensors = read_checkpoint(src.weight_files)
    report = cross_check(model, tensors, src.weight_files, quantization=src.config_dict.get("quantization_config"))
    if report.shape_mismatches:
        first = "; ".join(
            f"{m['name']}: checkpoint {m['checkpoint']} vs config {m['model']}" for m in report.shape_mismatches[:3]
        )
        more = len(report.shape_mismatches) - 3
        raise BadInput(
            f"{src.text}: weights do not match the config: {first}" + (f" (and {more} more)" if more > 0 else "")
        )
    if report.integer_for_float and not src.config_dict.get("quantization_config"):
        first = report.integer_for_float[0]
        raise BadInput(
            f"{src.text}: {len(report.integer_for_float)} tensor(s) hold integers where the model computes in floating "
            f"point (first: {first['name']}, {first['checkpoint']} on disk, {first['model']} in the model); a quantised "
            "checkpoint needs its quantization_config, otherwise the loader would cast the codes as if they were weights"
        )
    return report


def available_memory(device: str) -> int:
    """Bytes that a new allocation can still get on ``device`` (host RAM for the CPU)."""
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def check_fits(src: ModelSource, need_bytes: int, device: str, what: str, hint: str) -> None:
    """Refuse early, with the figures, what would otherwise die in the allocator or the OOM killer."""
    have = available_memory(device)
    if need_bytes > 0.9 * have:
        raise BadInput(
            f"{src.text}: {what} needs {need_bytes / 2**30:.1f} GiB but {device} has {have / 2**30:.1f} GiB available; {hint}"
        )


def parameter_bytes(src: ModelSource, dtype: torch.dtype) -> tuple[int, int]:
    """(all parameters, the largest single parameter) in bytes at ``dtype``, from the meta skeleton."""
    sizes = [p.numel() for p in build_meta_model(src).parameters()]
    return sum(sizes) * dtype.itemsize, max(sizes, default=0) * 4  # construction initialises in float32


def build_skeleton(src: ModelSource) -> nn.Module:
    """The model class transformers would load, parameters on meta, buffers computed for real.

    Parameters are created one at a time before moving to meta, so the largest one must fit.
    """
    config = load_config(src)
    cls = model_class(src, config)
    _, largest = parameter_bytes(src, torch.float32)
    check_fits(
        src, largest, "cpu", "building the skeleton (its largest parameter)", "this model is too large to align here"
    )
    try:
        with quiet_transformers(), parameters_on_meta():
            model = cls.from_config(config, trust_remote_code=src.trust_remote_code, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - remote model code can raise anything
        raise BadInput(f"{src.text}: transformers could not build the model skeleton: {err}") from None
    return model.eval()


def restore_computed_buffers(model: nn.Module, src: ModelSource) -> list[str]:
    """Copy the buffers that ``__init__`` computes into a loaded model where the loader left them unset.

    transformers 5's loader materialises a remote-code model's non-persistent buffers (e.g. a
    hand-written rotary ``inv_freq``) without computing them: their contents are whatever memory
    held.  Returns the names it repaired, so callers can report it.
    """
    fresh = _computed_buffers(src, f"{src.content_hash()}:{src.trust_remote_code}")
    repaired = []
    for name, buf in model.named_buffers():
        module_path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(module_path)
        if leaf not in owner._non_persistent_buffers_set:
            continue  # persistent buffers come from the checkpoint and are right as loaded
        want = fresh.get(name)
        if want is None or want.device.type == "meta" or want.shape != buf.shape:
            continue
        if not torch.equal(buf.detach().cpu(), want.to(buf.dtype)):
            owner._buffers[leaf] = want.to(device=buf.device, dtype=buf.dtype)
            repaired.append(name)
    return repaired


_BUFFER_CACHE: dict[str, dict[str, torch.Tensor]] = {}


def _computed_buffers(src: ModelSource, content_hash: str) -> dict[str, torch.Tensor]:
    """The buffers ``__init__`` computes, once per checkpoint content (building a skeleton costs seconds)."""
    if content_hash not in _BUFFER_CACHE:
        _BUFFER_CACHE.clear()
        _BUFFER_CACHE[content_hash] = dict(build_skeleton(src).named_buffers())
    return _BUFFER_CACHE[content_hash]


def _all_finite(tensor: torch.Tensor) -> bool:
    """Exact NaN/Inf check at the cost of one reduction: a sum is finite only if every term is.
    Only a non-finite sum (a NaN/Inf, or a finite overflow) pays for the elementwise check."""
    with torch.no_grad():
        return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def loop_experts(model: torch.nn.Module, notes: list[str] | None = None) -> None:
    """Run MoE experts through transformers' per-expert loop, where the model dispatches experts by name.

    The default grouped GEMM has no float64 kernel: without this a float64 reference of an MoE model
    fails, or silently runs in a narrower dtype.  The loop computes the same function in any dtype.
    """
    if getattr(model.config, "_experts_implementation", None) in (None, "eager"):
        return
    setter = getattr(model, "set_experts_implementation", None)
    if setter is None:
        return
    try:
        setter("eager")
    except (ValueError, RuntimeError, AttributeError) as err:
        if notes is not None:
            notes.append(f"experts stay on {model.config._experts_implementation}: {_first_line(err)}")
        return
    if notes is not None:
        notes.append("float64 model: experts run through the per-expert loop (grouped GEMM has no float64 kernel)")


def direct_placement(device: str) -> dict[str, Any]:
    """``from_pretrained`` arguments that load straight onto an accelerator, converting the dtype there.

    Loading on the host and moving afterwards converts every tensor on the CPU first (most of a
    multi-second load); transformers places tensors itself given a ``device_map``, which it accepts
    only with ``accelerate`` installed.  Without it, or for the CPU, the model loads on the host.
    """
    if torch.device(device).type == "cpu":
        return {}
    import importlib.util

    return {"device_map": device} if importlib.util.find_spec("accelerate") is not None else {}


_SAFETENSORS_FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def staging_dtype(src: ModelSource, dtype: torch.dtype, device: str) -> torch.dtype | None:
    """The checkpoint's own dtype to load in on the host when ``dtype`` only widens it on an accelerator.

    Without ``device_map`` placement transformers converts every tensor on the host, which for bf16 -> fp32
    is most of the load; widening is exact, so loading as stored and converting on the device gives the
    same weights.  None (load in ``dtype``) for the CPU, other formats, mixed floating dtypes, or a
    narrowing conversion.
    """
    if torch.device(device).type == "cpu" or src.weight_format != "safetensors" or not src.has_weights:
        return None
    from adapt.core.checkpoint import read_checkpoint

    stored = {
        _SAFETENSORS_FLOATS.get(t.dtype)
        for t in read_checkpoint(src.weight_files).values()
        if t.dtype.startswith(("F", "BF"))
    }
    if len(stored) != 1 or None in stored:
        return None
    (own,) = stored
    return own if own.itemsize < dtype.itemsize and dtype.is_floating_point else None


def _widen_dequantized(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters a dequantising load left narrower than asked, widened to ``dtype`` (exact) as its note says:
    transformers 5.17 leaves MXFP4 expert banks in bfloat16 whatever dtype the load asked for.  Parameters kept wider
    on purpose (a module transformers keeps in float32) stay as they are."""
    for param in model.parameters():
        if param.is_floating_point() and torch.finfo(param.dtype).bits < torch.finfo(dtype).bits:
            param.data = param.data.to(dtype)


def dequantize_on_load(src: ModelSource, config: Any, dtype: torch.dtype) -> str | None:
    """Have transformers' own quantizer turn stored quantised weights (fp8 blocks, MXFP4, ...) back into ``dtype``
    as it loads them, and say so; None when the weights are stored as floating point.

    Left quantised, transformers keeps inference-only modules (fp8 linears whose weights take no gradient), and the
    alignment and the training step would silently measure them or train around them.  A method transformers cannot
    dequantize on load (packed integers: GPTQ, AWQ, bitsandbytes) is refused as bad input."""
    stored = getattr(config, "quantization_config", None)
    if not stored:
        return None
    settings = stored if isinstance(stored, dict) else stored.to_dict()
    method = settings.get("quant_method", "unknown")
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    quantizer_config = AUTO_QUANTIZATION_CONFIG_MAPPING.get(str(method))
    if quantizer_config is None or "dequantize" not in inspect.signature(quantizer_config.__init__).parameters:
        raise BadInput(
            f"{src.text}: its weights are stored quantised ({method}), which transformers cannot turn back into "
            "floating point as it loads them; adapt aligns and trains floating-point weights: give it the "
            "unquantised checkpoint"
        )
    config.quantization_config = {**settings, "dequantize": True}
    return f"weights stored quantised ({method}): dequantized to {str(dtype).removeprefix('torch.')} on load by transformers"


def load_model(
    src: ModelSource, dtype: torch.dtype = torch.float32, device: str = "cpu", notes: list[str] | None = None
) -> torch.nn.Module:
    """The model with its real weights, through transformers' own loader (random init when config-only).

    Safetensors load by default; pickled ``.bin`` weights only with ``allow_pickle`` (transformers
    loads them with ``weights_only=True``).  Non-finite weights are refused, naming the tensors.
    Buffers that ``__init__`` computes but the loader left unset are recomputed; what was repaired
    is appended to ``notes``.
    """
    config = load_config(src)
    cls = model_class(src, config)
    total, _ = parameter_bytes(src, dtype)
    check_fits(
        src,
        total,
        device,
        f"loading the weights in {str(dtype).removeprefix('torch.')}",
        "align it with --streamed, or bench a depth-truncated copy with --max-layers",
    )
    placement = direct_placement(device)
    staged = None if placement else staging_dtype(src, dtype, device)
    dequantized = dequantize_on_load(src, config, dtype) if src.has_weights else None
    if dequantized and notes is not None and dequantized not in notes:
        notes.append(dequantized)
    try:
        with quiet_transformers():
            if src.has_weights:
                model = cls.from_pretrained(
                    src.root,
                    config=config,
                    dtype=staged or dtype,
                    trust_remote_code=src.trust_remote_code,
                    use_safetensors=src.weight_format == "safetensors",
                    **placement,
                )
            else:
                model = cls.from_config(config, dtype=dtype, trust_remote_code=src.trust_remote_code)
    except BadInput:
        raise
    except Exception as err:
        if "mismatched" in str(err) and src.weight_format == "safetensors":  # its report went to the silenced log
            check_checkpoint(src, build_meta_model(src, config))  # names the tensors and both shapes
        raise BadInput(f"{src.text}: transformers could not load the weights: {_first_line(err)}") from None
    if staged is not None:  # widen on the accelerator: exact, and no host pass over the weights
        model = model.to(device).to(dtype)
    if dequantized:
        _widen_dequantized(model, dtype)
    if dtype == torch.float64:
        loop_experts(model, notes)
        narrow = [n for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float64]
        if narrow:  # made in float32 by the model's own code (XLNet's torch.FloatTensor): the reference is float64
            model = model.to(torch.float64)
            if notes is not None:
                notes.append(f"float64 model: {len(narrow)} parameter(s) its code makes narrower widened ({narrow[0]})")
    bad = [name for name, p in model.named_parameters() if not _all_finite(p)]
    if bad:
        raise BadInput(f"{src.text}: non-finite (NaN/Inf) values in weights: {', '.join(bad[:3])}")
    if any(True for _ in model.buffers()):
        repaired = restore_computed_buffers(model, src)
        why = f"computed at {staged} when loaded as stored" if staged else "loader left computed buffers uninitialised"
        note = f"{why}, recomputed: {', '.join(repaired)}"
        if repaired and notes is not None and note not in notes:
            notes.append(note)
    return model.to(device).eval()
