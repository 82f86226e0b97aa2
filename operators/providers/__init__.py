"""Kernel providers: PyTorch-native fused ops, adapt's own Triton kernels, Liger-Kernel (optional).

The one list of providers, in the order a plan prefers them; each provider module depends only on the registry's
types, so this package sits above ``operators.registry``.
"""

from __future__ import annotations

from operators.registry import Provider, Target


def providers() -> list[Provider]:
    from operators.providers.adapt_triton import AdaptTritonProvider
    from operators.providers.liger import LigerProvider
    from operators.providers.torch_native import TorchNativeProvider

    return [TorchNativeProvider(), AdaptTritonProvider(), LigerProvider()]


def provider_status(target: Target) -> dict[str, str]:
    """Each provider's availability on ``target`` with the reason, for the report."""
    out = {}
    for prov in providers():
        ok, why = prov.available(target)
        out[prov.name] = ("available" + (f" ({why})" if why else "")) if ok else f"unavailable: {why}"
    return out
