"""Components found over the whole model once every module is classified: a norm fused with the residual add
before it, the vocabulary head with its loss (or alone, where the trace holds no loss), and modules that compute
but match no kind."""

from __future__ import annotations

import dataclasses
import functools

from torch import nn
from torch.utils._pytree import tree_flatten

from adapt.model.blocks import NoBlockList, find_blocks
from adapt.model.structure import same_tensor
from operators.inventory import OpInventory
from operators.recognition import patterns as pat
from operators.recognition import variants
from operators.recognition.attention import tanh_cap
from operators.recognition.component import Component, inside
from operators.recognition.head_probe import probe_lm_head_loss, probe_vocab_projection
from operators.recognition.probe_cache import ProbeCache, structure_key


def residual_norms(inv: OpInventory, found: list[Component]) -> list[Component]:
    """Norms whose input is the output of an ``aten.add`` run by the enclosing block: fusable add+norm."""
    out = []
    for comp in found:
        if comp.kind in ("rms_norm", "layer_norm") and comp.confirmed:
            rec = inv.modules[comp.module]
            if rec.fed_by_add is not None and (rec.fed_by_add == "" or comp.module.startswith(rec.fed_by_add + ".")):
                variant = variants.ResidualAddNormVariant(
                    norm=comp.kind,
                    add_in=rec.fed_by_add,
                    add_after=rec.fed_by_add_after,
                    add_index=rec.fed_by_add_index,
                    **dataclasses.asdict(comp.variant),
                )
                out.append(
                    Component(
                        comp.module,
                        "residual_add_norm",
                        variant,
                        True,
                        "norm input is the tensor an aten.add of an enclosing block produced",
                    )
                )
    return out


def shares_table(model: nn.Module, head: str, found: list[Component]) -> bool | None:
    """Whether the head's matrix is a table an embedding lookup reads: the same Parameter, or a view of the same
    storage (a copy kept in step would be two); None where no lookup was traced to compare it with."""
    tables = [
        p for c in found if c.kind == "embedding" for p in model.get_submodule(c.module).parameters() if p.dim() == 2
    ]
    if not tables:
        return None
    matrices = [p for p in model.get_submodule(head).parameters() if p.dim() == 2]
    return any(same_tensor(m, t) for m in matrices for t in tables)


def lm_head(
    model: nn.Module, inv: OpInventory, generator, can_probe: bool, cache: ProbeCache, found: list[Component]
) -> Component | None:
    """The vocabulary projection whose output the model's loss consumes, confirmed by the fused-loss probe
    (a forward of the whole model, so its verdict is keyed on the whole model's structure)."""
    head = pat.lm_head_candidate(inv)
    if head is None:
        return None
    root = inv.modules[""]
    names = [e[0] for e in root.sequence]
    softcap = tanh_cap(root.sequence, names.index("aten.tanh.default")) if "aten.tanh.default" in names else None
    variant = variants.HeadLossVariant(
        vocab=head.out_features, hidden=head.in_features, final_softcap=softcap,
        tied=shares_table(model, head.path, found),
    )  # fmt: skip
    confirmed, evidence, suffix = False, "pattern only", ""
    if can_probe:
        key = ("lm_head_loss", head.path, softcap, *structure_key(model, root, inv))
        run = functools.partial(probe_lm_head_loss, model, head.path, softcap, generator)
        (confirmed, evidence), suffix = cache.verdict(key, head.path, run)
    return Component(
        head.path,
        "lm_head_cross_entropy",
        variant,
        confirmed,
        f"projection onto the vocabulary feeds log_softmax + nll_loss; {evidence}{suffix}",
    )


def vocab_projection(
    model: nn.Module, inv: OpInventory, generator, can_probe: bool, cache: ProbeCache, reject, found: list[Component]
) -> Component | None:
    """The projection onto the vocabulary whose output the model returns, for a trace without the model's loss (its
    labelled call failed, its plain forward was traced): the projection alone, confirmed on a float64 copy; no loss
    is claimed, so no fused loss kernel is offered for it."""
    head = pat.vocab_projection_candidate(inv)
    if head is None:
        return None
    recorded = {"vocab": head.out_features, "hidden": head.in_features, "tied": shares_table(model, head.path, found)}
    call = inv.captured.get(head.path)
    if not can_probe or call is None:
        return Component(
            head.path, "vocab_projection", variants.VocabProjectionVariant(**recorded), False, "pattern only"
        )
    module, rec = model.get_submodule(head.path), inv.modules[head.path]
    run = functools.partial(probe_vocab_projection, module, call, generator)
    measured, suffix = cache.verdict(("vocab_projection", *structure_key(module, rec, inv)), head.path, run)
    if measured is None:
        reject(head.path, "vocab_projection", "not x @ W.T (+ b) of its own matrix and shift" + suffix)
        return None
    variant = variants.VocabProjectionVariant(**measured, **recorded)
    evidence = "projection onto the token table's vocabulary yields the model's output; float64 output+grad match"
    return Component(head.path, "vocab_projection", variant, True, evidence + suffix)


def block_paths(model: nn.Module) -> set[str]:
    """Paths of the model's repeated blocks (none when it has no block list)."""
    try:
        return {path for path, _ in find_blocks(model).named()}
    except NoBlockList:
        return set()


_RESIDUAL_OPS = {"aten.add.Tensor", "aten.add_.Tensor"}


def new_modules(inv: OpInventory, found: list[Component], blocks: set[str]) -> list[Component]:
    """Modules that compute (non-structural own ops) but sit in no recognised component: leaves, and containers
    whose own code does more than add residuals, inside a block (a gate, a recurrence) or, outside the blocks,
    around a projection no component holds (a head's transform or an embedding mix written inline).  Outside the
    blocks, a container computing around no such projection only builds positions and masks."""
    covered = {c.module for c in found}
    out = []
    for rec in inv.modules.values():
        if not rec.path or rec.path in covered or inside(rec.path, covered, strict=True):
            continue
        if any(rec.path.startswith(c.module + ".") for c in found):
            continue
        compute = pat.compute_ops(rec)
        in_block = rec.path not in blocks and any(rec.path.startswith(b + ".") for b in blocks)
        between = set(compute) - _RESIDUAL_OPS
        if compute and (
            not rec.children or (between and (in_block or _holds_bare_projection(inv, rec.path, covered, blocks)))
        ):
            variant = variants.NewVariant(
                ops=tuple(compute), container=bool(rec.children), python_sizes=takes_python_sizes(inv, rec.path)
            )
            out.append(Component(rec.path, "new", variant, False, "computes, matches no known kind"))
    return out


def _holds_bare_projection(inv: OpInventory, path: str, covered: set[str], blocks: set[str]) -> bool:
    """A projection below ``path``, outside the blocks, that no recognised component holds: matmul work that no
    known kind accounts for (linear layers alone count as bookkeeping, so only their container can report it)."""
    return any(not inside(p.path, covered | blocks, strict=False) for p in pat.projections_under(inv, path))


def takes_python_sizes(inv: OpInventory, path: str) -> bool:
    """The module's first traced call passed a Python integer, or a list of them, besides its tensors."""
    call = inv.captured.get(path)
    if call is None:
        return False
    values, _ = tree_flatten(call)
    return any(isinstance(v, int) and not isinstance(v, bool) for v in values)
