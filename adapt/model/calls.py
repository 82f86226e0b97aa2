"""How adapt calls a model it did not write: one answer for the keyword that turns its caches off, one for which
token ids it reads, and one for whether the model's own code refuses a batch of token ids."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn


def without_cache(model: nn.Module) -> dict[str, bool]:
    """``{"use_cache": False}`` when the model reads that flag, else no keyword.

    Recurrent and linear-attention layers may hold caches that only their own ``generate()`` sets up
    (a stack of them alone cannot even report a cached length), so adapt's own calls run uncached.
    A model reads the flag when its ``forward`` names it, or when it takes ``**kwargs`` and its
    config carries ``use_cache`` (transformers' causal LMs hand it down to the base model that way).
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature: do not guess a keyword
        return {}
    if "use_cache" in params:
        return {"use_cache": False}
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    config = getattr(model, "config", None)
    return {"use_cache": False} if takes_kwargs and hasattr(config, "use_cache") else {}


def token_vocab(model: nn.Module) -> int:
    """How many token ids the model reads: its input embedding's rows, and no more than the vocabulary its config
    states (its logits' width, which labels index) where that is smaller.  The one answer for every caller that
    draws token ids: a model's other embedding tables (BLT's hashed n-gram tables, larger than its byte vocabulary)
    say nothing about which ids it takes."""
    rows = int(model.get_input_embeddings().num_embeddings)
    stated = getattr(getattr(model, "config", None), "vocab_size", None)
    return min(rows, stated) if isinstance(stated, int) and stated > 0 else rows


def takes_argument(model: nn.Module, name: str) -> bool:
    """Whether the model's ``forward`` names the argument ``name``."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature: do not guess a keyword
        return False


def own_refusal(
    model: nn.Module, input_ids: torch.Tensor, loss: Callable[[nn.Module], torch.Tensor] | None = None
) -> str | None:
    """The model's own reason, on one line, when its plain forward on ``input_ids`` (or, given ``loss``, the backward
    of ``loss(model)``) raises from its own code.

    A draft model that needs its target's states, or one that needs a language chosen first, refuses a batch
    of token ids with an exception its own forward raises; Reformer's reversible layers refuse a backward outside
    training mode.  Only the model's code counts: the raising frame must belong to a module that defines a class the
    model is built from (torch's own classes left out), so an op failing deep inside torch, or adapt's own code, is
    never taken for the model's refusal.  None when it runs.  Given ``loss``, only the backward is judged (the
    forward is the plain call's to judge, and ``loss`` is the caller's code); the gradients it leaves are the
    caller's to undo.
    """
    try:
        if loss is None:
            with torch.no_grad():
                model(input_ids=input_ids, **without_cache(model))
        else:
            try:
                value = loss(model)
            except Exception:  # noqa: BLE001 - not the backward: the caller's failure stays the caller's
                return None
            value.backward()
    except Exception as err:  # noqa: BLE001 - judged below: anything but the model's own refusal stays the caller's
        if _raising_module(err) in _model_code(model):
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            return f"{type(err).__name__}: {' '.join(lines)}"
    return None


def library_failure(model: nn.Module, err: BaseException) -> str | None:
    """``err`` on one line, with where it was raised, when that was the model's own code or transformers' (its cache
    and config classes), not adapt's or torch's: the checkpoint's software failing, which adapt reports as a finding
    instead of crashing on it.  BLT's cache, built from a config without ``num_hidden_layers``, is one."""
    where = _raising_module(err)
    if where is None or not (where in _model_code(model) or where.split(".")[0] == "transformers"):
        return None
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {' '.join(lines)[:240]} (in {where})"


def _model_code(model: nn.Module) -> set[str]:
    """Names of the Python modules defining the classes (and their bases) the model's modules are made of."""
    classes = {cls for module in model.modules() for cls in type(module).__mro__}
    return {cls.__module__ for cls in classes if cls.__module__.split(".")[0] not in ("torch", "builtins")}


def _raising_module(err: BaseException) -> str | None:
    """The Python module whose code raised ``err`` (its traceback's innermost frame)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_globals.get("__name__") if tb is not None else None
