"""Candidate component kinds from the shape of a module's traced subgraph.

Everything here reads the ``ModuleRecord``s of an ``OpInventory``: which ATen ops a subtree ran,
parameter shapes, traced input/output shapes and the op sequence.  The result is only a
*candidate*; ``probes`` confirms or rejects it numerically.  Class names are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

from operators.inventory import ModuleRecord, OpInventory

MATMUL_OPS = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.matmul.default",
    "aten._grouped_mm.default",
)
SOFTMAX_OPS = ("aten._softmax.default", "aten._safe_softmax.default")
SDPA_PREFIX = "aten._scaled_dot_product"
FLEX_PREFIX = "higher_order.flex_attention"

# Ops that move or view data, or are pure bookkeeping: a module made only of these computes nothing new.
STRUCTURAL_OPS = {
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.transpose.int",
    "aten.t.default",
    "aten.permute.default",
    "aten.expand.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.slice.Tensor",
    "aten.clone.default",
    "aten.detach.default",
    "aten.alias.default",
    "aten.lift_fresh.default",
    "aten._to_copy.default",
    "aten.contiguous.default",
    "aten.select.int",
    "aten.split.Tensor",
    "aten.split_with_sizes.default",
    "aten.embedding.default",
    "aten.mm.default",
    "aten.addmm.default",
    "aten.native_dropout.default",
}

ACTIVATION_OPS = {
    "aten.gelu.default",
    "aten.silu.default",
    "aten.relu.default",
    "aten.tanh.default",
    "aten.sigmoid.default",
    "aten.hardtanh.default",
    "aten.elu.default",
    "aten.leaky_relu.default",
    "aten.mish.default",
}


@dataclass
class TracedProjection:
    """A leaf module with a 2-D weight that maps one width to another (Linear, Conv1D, ...)."""

    path: str
    in_features: int
    out_features: int


def has_any(ops: dict[str, int], names: tuple[str, ...]) -> bool:
    return any(op in ops for op in names)


def has_prefix(ops: dict[str, int], prefix: str) -> bool:
    return any(op.startswith(prefix) for op in ops)


def attention_core_ops(ops: dict[str, int]) -> bool:
    batched = "aten.bmm.default" in ops  # QK^T / PV are batched products; routers use plain mm
    return has_prefix(ops, SDPA_PREFIX) or has_prefix(ops, FLEX_PREFIX) or (has_any(ops, SOFTMAX_OPS) and batched)


def last_dim(shapes: list[list[int]]) -> int | None:
    return shapes[0][-1] if shapes and shapes[0] else None


def projections_under(inv: OpInventory, path: str, *, direct_only: bool = False) -> list[TracedProjection]:
    """Leaf projections in ``path``'s subtree, with their traced in/out widths."""
    found = []
    prefix = path + "." if path else ""
    for rec in inv.modules.values():
        if not rec.path.startswith(prefix) or rec.children:
            continue
        if direct_only and rec.path.count(".") != path.count(".") + (1 if path else 0):
            continue
        if sum(1 for s in rec.params.values() if len(s) == 2) != 1 or not has_any(rec.ops, MATMUL_OPS):
            continue
        fin, fout = last_dim(rec.input_shapes), last_dim(rec.output_shapes)
        if fin and fout:
            found.append(TracedProjection(rec.path, fin, fout))
    return found


def is_norm_candidate(rec: ModuleRecord) -> bool:
    """Row-wise normalisation shape: same in/out width, 1-D parameters of that width, a reduction, no matmul."""
    width = last_dim(rec.input_shapes)
    if not width or not rec.output_shapes or rec.output_shapes[0] != rec.input_shapes[0] or rec.children:
        return False
    if any(len(s) != 1 or s[0] != width for s in rec.params.values()):
        return False
    if has_any(rec.ops, MATMUL_OPS):
        return False
    return runs_norm(rec.ops, rec.scalars)


def runs_norm(ops: dict[str, int], scalars: list[float]) -> bool:
    """The ops hold a row normalisation: a fused ATen norm, or a reduction and a root."""
    reduces = has_any(ops, ("aten.mean.dim", "aten.var_mean.correction", "aten.sum.dim_IntList"))
    fused = any("layer_norm" in op or "rms_norm" in op for op in ops)
    # The root as rsqrt, sqrt, or a power of -0.5 or 0.5 (Gemma 4 writes ``torch.pow(mean_squared, -0.5)``).
    half_power = "aten.pow.Tensor_Scalar" in ops and any(abs(s) == 0.5 for s in scalars)
    root = has_any(ops, ("aten.rsqrt.default", "aten.sqrt.default")) or half_power
    return fused or (reduces and root)


def is_mlp_candidate(inv: OpInventory, rec: ModuleRecord) -> bool:
    """A width-preserving module made of 2-3 projections and elementwise ops, no attention or routing."""
    width = last_dim(rec.input_shapes)
    if not width or last_dim(rec.output_shapes) != width or not rec.children:
        return False
    if attention_core_ops(rec.ops) or "aten.topk.default" in rec.ops:
        return False
    projs = projections_under(inv, rec.path)
    if len(projs) not in (2, 3):
        return False
    ups = [p for p in projs if p.in_features == width]
    downs = [p for p in projs if p.out_features == width and p.in_features != width]
    return bool(ups) and len(downs) == 1


def lone_projection(inv: OpInventory, rec: ModuleRecord) -> TracedProjection | None:
    """The one projection of a container that neither attends nor routes and owns no matrix itself: what each
    half of an MLP or attention output split across two modules (BERT's) is built around."""
    if not rec.children or len(rec.output_shapes) != 1 or any(len(s) >= 2 for s in rec.params.values()):
        return None
    if attention_core_ops(rec.ops) or "aten.topk.default" in rec.ops:
        return None
    projs = projections_under(inv, rec.path)
    return projs[0] if len(projs) == 1 else None


def is_projection_activation_candidate(inv: OpInventory, rec: ModuleRecord) -> bool:
    """One tensor in, its projection out through an activation, perhaps normalised last: an MLP's up half in a
    module of its own, or a prediction head's transform (BERT's)."""
    proj = lone_projection(inv, rec)
    if proj is None or len(rec.input_shapes) != 1:
        return False
    (inp,), (out,) = rec.input_shapes, rec.output_shapes
    return (
        inp[:-1] == out[:-1]
        and (proj.in_features, proj.out_features) == (inp[-1], out[-1])
        and has_any(rec.ops, tuple(ACTIVATION_OPS))
    )


def is_projection_residual_norm_candidate(inv: OpInventory, rec: ModuleRecord) -> bool:
    """Called with two tensors, the branch and the residual: the branch's projection, an add and perhaps a norm (the
    down half of a split MLP, or an attention's output projection in a module of its own; a pre-norm layer's adds
    without normalising)."""
    proj = lone_projection(inv, rec)
    if proj is None or len(rec.input_shapes) != 2:
        return False
    (out,) = rec.output_shapes
    branch = [s for s in rec.input_shapes if s[:-1] == out[:-1] and s[-1] == proj.in_features]
    return proj.out_features == out[-1] and out in rec.input_shapes and bool(branch) and "aten.add.Tensor" in rec.ops


def is_attention_candidate(inv: OpInventory, rec: ModuleRecord) -> bool:
    """The module that runs the softmax(QK^T)V core itself and owns the projections around it."""
    return attention_core_ops(rec.own_ops) and len(projections_under(inv, rec.path)) >= 2


def routed_experts_call(rec: ModuleRecord) -> tuple[int, int] | None:
    """(width, top_k) of a module called as ``experts(hidden [T, H], index [T, k], weights [T, k])`` that holds
    expert banks of its own (3-D parameters over one count of experts) and returns ``[T, H]``; None otherwise."""
    shapes = rec.input_shapes
    if len(shapes) < 3 or len(shapes[0]) != 2 or len(shapes[1]) != 2 or shapes[1] != shapes[2]:
        return None
    if shapes[1][0] != shapes[0][0] or rec.output_shapes[:1] != shapes[:1]:
        return None
    banks = [shape for shape in rec.params.values() if len(shape) == 3]
    if len(banks) < 2 or len({shape[0] for shape in banks}) != 1:
        return None
    return shapes[0][1], shapes[1][1]


def is_moe_candidate(inv: OpInventory, rec: ModuleRecord) -> bool:
    """Width-preserving module with a top-k routing decision and many experts' weights below it."""
    return is_routed(inv, rec) and bool(expert_weights(inv, rec.path, scored_experts(inv, rec)))


def scored_experts(inv: OpInventory, rec: ModuleRecord) -> int | None:
    """How many experts the module's router scores."""
    router = router_of(inv, rec)
    return router_rows(inv, router) if router else None


def router_rows(inv: OpInventory, router: tuple[str, str]) -> int | None:
    """The rows of a router's [num_experts, width] matrix (``router_of``'s module and dotted parameter name)."""
    owner, _, name = f"{router[0]}.{router[1]}".rpartition(".")
    shape = inv.modules[owner].params.get(name) if owner in inv.modules else None
    return shape[0] if shape else None


def is_routed(inv: OpInventory, rec: ModuleRecord, num_experts: int | None = None) -> bool:
    """Width-preserving module with a top-k routing decision over a router matrix (experts in any container)."""
    width = last_dim(rec.input_shapes)
    if not width or last_dim(rec.output_shapes) != width or "aten.topk.default" not in rec.ops:
        return False
    if attention_core_ops(rec.ops):
        return False  # a whole block, not the MoE inside it
    return bool(router_of(inv, rec, num_experts))


def router_of(inv: OpInventory, rec: ModuleRecord, num_experts: int | None = None) -> tuple[str, str] | None:
    """(module, param) of the [num_experts, width] router matrix: the 2-D weight inside the routing subtree; or,
    when a module's own code runs the top-k over a direct child's projection, that child's [num_experts, width]
    weight.  The experts are counted by the caller (a list's length) or by what the top-k chooses among.  The
    top-k running in the MoE module itself makes the child the router; a gating module of its own stays the
    router, its weight named through the child ("layer.weight"), so the module whose outputs hooks record
    (the router logits, for the load-balancing loss) is the one called for them."""
    width = last_dim(rec.input_shapes)
    for sub in _subtree(inv, rec.path):
        if "aten.topk.default" not in sub.ops:
            continue
        for name, shape in sub.params.items():
            if len(shape) == 2 and shape[1] == width and shape[0] > 1:
                return sub.path, name
    for sub in _subtree(inv, rec.path):
        if "aten.topk.default" not in sub.own_ops:
            continue
        counted = num_experts or _chosen_among(sub)
        # a child's own matrix first; then one its projection holds (DBRX's router keeps it on ``router.layer``)
        for deeper in (False, True):
            for child in sub.children:
                for owner in _subtree(inv, child) if deeper else [inv.modules[child]] if child in inv.modules else []:
                    for name, shape in owner.params.items():
                        if list(shape) == [counted, width]:
                            base = child if sub.path == rec.path else sub.path
                            return base, f"{owner.path[len(base) + 1 :]}.{name}".lstrip(".")
    return None


def _chosen_among(rec: ModuleRecord) -> int | None:
    """How many candidates the module's last top-k chooses among (the experts, after any group masking)."""
    topks = [entry for entry in rec.sequence if entry[0] == "aten.topk.default" and entry[1] and entry[1][0]]
    return int(topks[-1][1][0][-1]) if topks else None


def expert_weights(inv: OpInventory, path: str, num_experts: int | None = None) -> list[tuple[str, str, list[int]]]:
    """Expert banks under ``path`` as (module, parameter, [num_experts, out, in]): 3-D parameters; or, with
    ``num_experts`` known and no 3-D bank there, 2-D matrices that stack the experts in their rows (DBRX keeps each
    of its three banks as one [experts x inner, width] matrix), read as [num_experts, inner, width] views.  Row-stacked
    banks are only looked for as two or more such matrices owned by one module: a linear layer owns one."""
    banks = [(sub.path, n, s) for sub in _subtree(inv, path) for n, s in sub.params.items() if len(s) == 3]
    if banks or not num_experts:
        return banks
    width = last_dim(inv.modules[path].input_shapes)
    for sub in _subtree(inv, path):
        rows = [(n, s) for n, s in sub.params.items() if len(s) == 2 and width in s and _stacks(s, width, num_experts)]
        if len(rows) >= 2:
            banks += [(sub.path, n, [num_experts, s[0] // num_experts, s[1]]) for n, s in rows]
    return banks


def _stacks(shape: list[int], width: int, num_experts: int) -> bool:
    """A [rows, width] matrix whose rows divide into ``num_experts`` equal blocks of more than one row."""
    rows, cols = shape
    return cols == width and rows % num_experts == 0 and rows // num_experts > 1


def rotary_generator(rec: ModuleRecord) -> bool:
    """Parameter-free module emitting two same-shaped tables built with cos and sin."""
    return (
        not rec.params
        and len(rec.output_shapes) == 2
        and rec.output_shapes[0] == rec.output_shapes[1]
        and "aten.cos.default" in rec.ops
        and "aten.sin.default" in rec.ops
    )


def lm_head_candidate(inv: OpInventory) -> TracedProjection | None:
    """The projection onto the vocabulary whose output the model's own loss consumes."""
    root = inv.modules.get("")
    if (
        root is None
        or not has_any(root.ops, ("aten._log_softmax.default",))
        or "aten.nll_loss_forward.default" not in root.ops
    ):
        return None
    vocab = last_dim(root.output_shapes)
    heads = [p for p in projections_under(inv, "") if p.out_features == vocab]
    return heads[-1] if heads else None


def vocab_projection_candidate(inv: OpInventory) -> TracedProjection | None:
    """The projection onto the vocabulary that yields the model's output, for a trace without the model's loss: its
    output has the shape of the model's, and its width is the row count of a table the model's own token ids index."""
    root = inv.modules.get("")
    if root is None or not root.output_shapes or not root.output_shapes[0]:
        return None
    out = root.output_shapes[0]
    vocabularies = token_table_rows(inv)
    heads = [
        p
        for p in projections_under(inv, "")
        if p.out_features == out[-1]
        and p.out_features in vocabularies
        and inv.modules[p.path].output_shapes[:1] == [out]
    ]
    return heads[-1] if heads else None


def token_table_rows(inv: OpInventory) -> set[int]:
    """Row counts of the lookup tables indexed by the model's token ids: a lookup called with a tensor of the ids'
    shape and, where the trace kept real calls, with the very ids the model was called with (not position or
    segment ids of that shape)."""
    ids = [v for v in _tensors(inv.captured.get("")) if not v.is_floating_point() and not v.is_meta]
    rows = set()
    for rec in inv.modules.values():
        if "aten.embedding.default" not in rec.own_ops or rec.input_shapes[:1] != [inv.input_shape]:
            continue
        looked_up = _tensors(inv.captured.get(rec.path))[:1]
        if ids and not any(i.shape == t.shape and torch.equal(i, t) for i in ids for t in looked_up):
            continue
        rows |= {shape[0] for shape in rec.params.values() if len(shape) == 2}
    return rows


def _tensors(call: tuple[tuple, dict] | None) -> list[torch.Tensor]:
    return [v for v in tree_leaves(call) if isinstance(v, torch.Tensor)] if call is not None else []


def compute_ops(rec: ModuleRecord) -> list[str]:
    """The module's own ops that compute something (``STRUCTURAL_OPS`` left out)."""
    return sorted(op for op in rec.own_ops if op not in STRUCTURAL_OPS)


def is_activation_only(rec: ModuleRecord) -> bool:
    """A parameterless leaf whose only computing op is one elementwise activation."""
    ops = compute_ops(rec)
    return not rec.children and not rec.params and len(ops) == 1 and ops[0] in ACTIVATION_OPS


def _subtree(inv: OpInventory, path: str) -> list[ModuleRecord]:
    prefix = path + "."
    return [r for r in inv.modules.values() if r.path == path or r.path.startswith(prefix)]
