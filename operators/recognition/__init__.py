"""Structural recognition: candidate kind from the traced subgraph, confirmed by a numeric probe.

``recognise(model, inventory)`` walks every traced module; ``classifiers`` asks ``patterns`` for a
candidate kind and runs that kind's probe on fresh random data, and ``whole_model`` adds what spans
modules (residual add+norm, the head with its loss or alone, code that matches no kind).  Confirmed components
carry the variant parameters a kernel needs (eps, offset, cast order, activation, window, softcap,
routing) and the attribute names found during recognition, so the patcher can call a kernel with
the module's own parameters; each kind's variant is its dataclass in ``variants``.  Modules that
compute something but match no kind are reported as ``new``; they run through decomposition or a
generated kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from operators.inventory import OpInventory
from operators.recognition import variants
from operators.recognition.classifiers import candidate_name, classify
from operators.recognition.component import Component, inside
from operators.recognition.probe_cache import ProbeCache
from operators.recognition.whole_model import block_paths, lm_head, new_modules, residual_norms, vocab_projection

KINDS = (
    "rms_norm",
    "layer_norm",
    "gated_mlp",
    "mlp",
    "projection_activation",
    "projection_residual_norm",
    "attention",
    "rotary",
    "rotary_application",
    "moe",
    "routed_experts",
    "residual_add_norm",
    "lm_head_cross_entropy",
    "vocab_projection",
    "embedding",
    "activation",
)


# Components whose children stay separately recognisable (q/k norms, MLA latent norms, shared experts, the norm
# after a projection's residual add, which keeps its own kernel choice).
_OPEN_KINDS = ("attention", "moe", "projection_residual_norm")


@dataclass
class Recognition:
    components: list[Component]
    rejected: list[dict[str, str]]  # candidates whose probe failed: module, candidate, reason

    def by_kind(self, kind: str) -> list[Component]:
        return [c for c in self.components if c.kind == kind]

    def to_dict(self) -> dict[str, Any]:
        return {"components": [c.to_dict() for c in self.components], "rejected": self.rejected}


def recognise(
    model: nn.Module, inventory: OpInventory, *, seed: int = 0, probe: bool = True, cache: ProbeCache | None = None
) -> Recognition:
    """Recognise every component of ``model`` from ``inventory`` (traced with ``capture=True``).

    With ``probe=False`` (meta-device models) candidates are reported unconfirmed.  Norm, MLP and
    attention probes run once per distinct structure (``probe_cache``); pass ``cache`` to see how many ran.
    """
    generator = torch.Generator().manual_seed(seed)
    can_probe = probe and inventory.device != "meta"
    found: list[Component] = []
    rejected: list[dict[str, str]] = []
    claimed: set[str] = set()  # modules inside an accepted component
    moes: set[str] = set()  # confirmed MoE blocks, whose experts are not recognised on their own

    def accept(comp: Component) -> None:
        found.append(comp)
        if comp.kind not in _OPEN_KINDS:
            claimed.add(comp.module)

    def reject(path: str, candidate: str, reason: str) -> None:
        rejected.append({"module": path, "candidate": candidate, "reason": reason})

    cache = cache if cache is not None else ProbeCache()
    records = sorted(inventory.modules.values(), key=lambda r: r.path.count("."))  # outermost first
    for rec in records:
        if not rec.path or inside(rec.path, claimed, strict=True):
            continue
        module = model.get_submodule(rec.path)
        try:
            comp, extra = classify(module, rec, inventory, generator, can_probe, cache, reject)
        except Exception as err:  # noqa: BLE001 - a probe that cannot call the module rejects it, never the stage
            reject(
                rec.path,
                candidate_name(inventory, rec),
                f"probe could not run the module: {type(err).__name__}: {str(err)[:200]}",
            )
            continue
        if comp is not None and comp.kind == "routed_experts" and inside(rec.path, moes, strict=True):
            continue  # the enclosing block's routing was recognised: its kernel runs these experts too
        if comp is not None:
            accept(comp)
            if comp.kind == "moe" and comp.confirmed:
                moes.add(comp.module)
            found.extend(extra)
            if isinstance(comp.variant, variants.MoEVariant) and comp.variant.experts:
                claimed.add(comp.variant.experts)  # experts kept as a list belong to their MoE, not each its own MLP
    found.extend(residual_norms(inventory, found))
    head = lm_head(model, inventory, generator, can_probe, cache, found)
    if head is None:  # no loss in the trace: the vocabulary projection alone
        head = vocab_projection(model, inventory, generator, can_probe, cache, reject, found)
    elif can_probe and not head.confirmed:  # a loss the fused kernel does not reproduce: claim the projection only
        projection = vocab_projection(model, inventory, generator, can_probe, cache, reject, found)
        if projection is not None and projection.confirmed:
            reject(head.module, head.kind, head.evidence)
            head = projection
    if head is not None:
        found.append(head)
    found.extend(new_modules(inventory, found, block_paths(model)))
    return Recognition(sorted(found, key=lambda c: c.module), rejected)
