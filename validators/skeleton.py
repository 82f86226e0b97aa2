"""A model skeleton whose parameters live on the meta device while its buffers are real.

Streamed alignment and depth-truncated benchmarks need the module tree, the real buffers that
``__init__`` computes (rotary ``inv_freq``, causal-mask tables) and no memory for weights.
``torch.device("meta")`` would put the buffers on meta as well; instead ``register_parameter``
is wrapped so each parameter is moved to meta as it is registered (accelerate's
``init_empty_weights(include_buffers=False)`` does the same).  The one-at-a-time construction
allocates one parameter at a time, never the whole model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from adapt.errors import BadInput


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


def build_skeleton(src) -> nn.Module:
    """The model class transformers would load, parameters on meta, buffers computed for real."""
    from adapt.skeleton import _quiet, load_config, model_class

    config = load_config(src)
    cls = model_class(src, config)
    try:
        with _quiet(), parameters_on_meta():
            model = cls.from_config(config, trust_remote_code=src.trust_remote_code, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - remote model code can raise anything
        raise BadInput(f"{src.text}: transformers could not build the model skeleton: {err}") from None
    return model.eval()


def restore_computed_buffers(model: nn.Module, src) -> list[str]:
    """Copy the buffers that ``__init__`` computes into a loaded model where the loader left them unset.

    transformers 5's loader materialises a remote-code model's non-persistent buffers (e.g. a
    hand-written rotary ``inv_freq``) without computing them: their contents are whatever memory
    held.  Returns the names it repaired, so callers can report it.
    """
    fresh = _computed_buffers(src, f"{src.content_hash()}:{src.trust_remote_code}")
    repaired = []
    for name, buf in model.named_buffers():
        want = fresh.get(name)
        if want is None or want.device.type == "meta" or want.shape != buf.shape:
            continue
        if not torch.equal(buf.detach().cpu(), want.to(buf.dtype)):
            module_path, _, leaf = name.rpartition(".")
            owner = model.get_submodule(module_path)
            owner._buffers[leaf] = want.to(device=buf.device, dtype=buf.dtype)
            repaired.append(name)
    return repaired


_BUFFER_CACHE: dict[str, dict[str, torch.Tensor]] = {}


def _computed_buffers(src, content_hash: str) -> dict[str, torch.Tensor]:
    """The buffers ``__init__`` computes, once per checkpoint content (building a skeleton costs seconds)."""
    if content_hash not in _BUFFER_CACHE:
        _BUFFER_CACHE.clear()
        _BUFFER_CACHE[content_hash] = dict(build_skeleton(src).named_buffers())
    return _BUFFER_CACHE[content_hash]


def load_model(src, dtype: torch.dtype, device: str, notes: list[str] | None = None) -> nn.Module:
    """``adapt.skeleton.load_model`` plus :func:`restore_computed_buffers`; repairs go into ``notes``."""
    from adapt.skeleton import load_model as intake_load_model

    model = intake_load_model(src, dtype=dtype, device=device)
    repaired = restore_computed_buffers(model, src)
    if repaired and notes is not None:
        note = f"loader left computed buffers uninitialised, recomputed: {', '.join(repaired)}"
        if note not in notes:
            notes.append(note)
    return model
