"""How adapt calls a model it did not write: one answer for the keyword that turns its caches off."""

from __future__ import annotations

import inspect

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
