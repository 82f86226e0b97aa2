"""Find the parts a parallelism needs (blocks, embedding, head, projections, experts) by structure.

Nothing here reads a class name or ``model_type``.  One short traced forward records, for every
module, which tensor it read and in what order it ran; the roles follow from data flow:

* blocks: the ``nn.ModuleList`` holding most parameters;
* embedding: the ``nn.Embedding`` that reads the token ids; head: the last module run whose
  output width is the vocabulary; final norm: the last parameter-holding module between them;
* inside a block, a *branch* is a direct child that holds linears or expert weights (attention,
  MLP, MoE); hidden-width modules with only 1-D parameters are the block's norms;
* in a branch, linears that read the branch input fan out (colwise under TP); the last linear
  that writes back to hidden width fans in (rowwise); 1-D-parameter modules applied to 4-D
  ``[batch, seq, heads, head_dim]`` tensors are per-head norms (QK-norm);
* a branch that receives context besides the hidden stream (rotary tables, masks) is attention;
* an experts container is a module whose own parameters are all >=3-D with one leading expert dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adapt.core.errors import BadInput
from adapt.model.blocks import NoBlockList, find_blocks
from adapt.model.calls import token_vocab


@dataclass
class BranchParts:
    path: str  # relative to the block
    attention: bool
    colwise: list[str] = field(default_factory=list)  # relative to the block
    rowwise: list[str] = field(default_factory=list)
    head_norms: list[str] = field(default_factory=list)  # per-head norms, heads on dim -2
    experts: str | None = None  # experts container, relative to the block
    unplaced: list[str] = field(default_factory=list)  # linears TP cannot place


@dataclass
class BlockPlacement:
    """One block as tensor parallelism places it: its norms and its branches' projections."""

    path: str  # absolute, e.g. "model.layers.3"
    norms: list[str]  # relative to the block
    branches: list[BranchParts]


@dataclass
class HeadGeometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class ModelParts:
    blocks_path: str
    blocks: list[BlockPlacement]
    embedding: str
    final_norm: str | None
    head: str | None
    tied: bool
    hidden_size: int
    vocab_size: int
    heads: HeadGeometry | None
    # Integer attributes of attention modules that hold head counts and must become local under TP
    # (found by ``tensor_parallel.find_head_count_attributes``; empty when reshapes infer heads).
    head_count_attrs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return dataclasses.asdict(self)


@dataclass
class _Call:
    name: str
    order: int
    inputs: list[torch.Tensor]
    has_context: bool  # received tensors (or tuples of tensors) besides the first input
    output: torch.Tensor | None = None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.data_ptr() == b.data_ptr()


def _reads_ids(seen: torch.Tensor, input_ids: torch.Tensor) -> bool:
    """The token ids themselves, or the same ids laid out otherwise (XLNet runs sequence-first: it transposes them)."""
    if _same(seen, input_ids):
        return True
    return (
        seen.dtype == input_ids.dtype
        and seen.numel() == input_ids.numel()
        and torch.equal(seen.flatten().sort().values, input_ids.flatten().sort().values)
    )


def _trace(model: nn.Module, input_ids: torch.Tensor) -> dict[str, _Call]:
    """First call of every module, with the tensors it read and returned."""
    calls: dict[str, _Call] = {}
    handles = []

    def pre(name):
        def hook(module, args, kwargs):
            if name in calls:
                return
            found = _tensors(list(args)) + _tensors(list(kwargs.values()))
            calls[name] = _Call(name, len(calls), found[:1], has_context=len(found) > 1)

        return hook

    def post(name):
        def hook(module, args, kwargs, output):
            call = calls.get(name)
            if call is not None and call.output is None:
                outs = _tensors(output if not hasattr(output, "to_tuple") else output.to_tuple())
                call.output = outs[0] if outs else None

        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name), with_kwargs=True))
    forward_with_hooks(model, input_ids, handles)
    return calls


def forward_with_hooks(model: nn.Module, input_ids: torch.Tensor, handles: list) -> None:
    """One gradient-free forward that exists only to fire ``handles``' hooks, which it then removes."""
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters(recurse=False))


def _is_expert_container(module: nn.Module) -> bool:
    params = _own_params(module)
    return bool(params) and all(p.ndim >= 3 for p in params) and len({p.shape[0] for p in params}) == 1


def _is_norm(module: nn.Module, width: int | None = None) -> bool:
    params = list(module.parameters())
    return bool(params) and all(p.ndim == 1 for p in params) and (width is None or params[0].numel() == width)


def _reads_4d(call: _Call) -> bool:
    return bool(call.inputs) and call.inputs[0].ndim == 4


def _branch_parts(block: nn.Module, block_path: str, child: str, calls: dict[str, _Call], hidden: int) -> BranchParts:
    prefix = f"{block_path}.{child}"
    call = calls.get(prefix)
    branch = BranchParts(path=child, attention=bool(call and call.has_context))
    branch_in = call.inputs[0] if call and call.inputs else None
    linears = []
    for rel, module in block.get_submodule(child).named_modules(prefix=child):
        absolute = f"{block_path}.{rel}"
        if _is_expert_container(module):
            branch.experts = rel
        elif isinstance(module, nn.Linear) and absolute in calls:
            linears.append((calls[absolute].order, rel, module, calls[absolute]))
        elif rel != child and _is_norm(module) and absolute in calls and _reads_4d(calls[absolute]):
            branch.head_norms.append(rel)
    linears.sort(key=lambda item: item[0])
    back = [item for item in linears if item[2].out_features == hidden]
    fan_in = back[-1][1] if back else None
    for _, rel, _module, lin_call in linears:
        if rel == fan_in:
            branch.rowwise.append(rel)
        elif branch_in is not None and lin_call.inputs and _same(lin_call.inputs[0], branch_in):
            branch.colwise.append(rel)
        else:
            branch.unplaced.append(rel)
    return branch


def find_parts(model: nn.Module, heads: HeadGeometry | None = None, seq_len: int = 8) -> ModelParts:
    """Trace ``model`` once on random token ids and return the roles of its modules."""
    try:
        found = find_blocks(model)
    except NoBlockList as err:
        raise BadInput(str(err)) from None
    blocks_path, blocks = found.path, found.blocks
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise BadInput("no token embedding (nn.Embedding) found in the model")
    device = next(model.parameters()).device
    vocab = token_vocab(model)
    input_ids = torch.randint(0, vocab, (1, seq_len), device=device)
    calls = _trace(model, input_ids)
    readers = [n for n, m in embeddings if n in calls and calls[n].inputs and _reads_ids(calls[n].inputs[0], input_ids)]
    if not readers:
        raise BadInput("no embedding reads the token ids")
    embedding = readers[0]
    hidden = model.get_submodule(embedding).embedding_dim
    block_names = [f"{blocks_path}.{i}" for i in range(len(blocks))]
    last_block = max(calls[n].order for n in block_names if n in calls)
    inside = tuple(n + "." for n in block_names)
    after = [c for c in calls.values() if c.order > last_block and not c.name.startswith(inside) and c.name != ""]
    head = None
    for c in sorted(after, key=lambda c: c.order):
        mod = model.get_submodule(c.name)
        if isinstance(mod, nn.Linear) and mod.out_features == vocab and mod.in_features == hidden:
            head = c.name
    final_norm = None
    for c in sorted(after, key=lambda c: c.order):
        mod = model.get_submodule(c.name)
        if c.name != head and _own_params(mod) and _is_norm(mod, hidden):
            final_norm = c.name
    tied = head is not None and model.get_submodule(head).weight is model.get_submodule(embedding).weight
    parts_blocks = []
    for path, block in zip(block_names, blocks):
        norms, branches = [], []
        for child, module in block.named_children():
            holds_linear = any(isinstance(m, nn.Linear) or _is_expert_container(m) for m in module.modules())
            if holds_linear:
                branches.append(_branch_parts(block, path, child, calls, hidden))
            elif _is_norm(module, hidden):
                norms.append(child)  # per-token, per-channel: norms and other pointwise ops (SP-safe)
        parts_blocks.append(BlockPlacement(path=path, norms=norms, branches=branches))
    return ModelParts(
        blocks_path=blocks_path,
        blocks=parts_blocks,
        embedding=embedding,
        final_norm=final_norm,
        head=head,
        tied=tied,
        hidden_size=hidden,
        vocab_size=vocab,
        heads=heads or head_geometry(model),
    )


def head_geometry(model: nn.Module, spec: Any = None) -> HeadGeometry | None:
    """Head counts from a ModelSpec block when given, else from the HF config's standard fields."""
    if spec is not None:
        attn = next((b.attention for b in spec.blocks if b.attention is not None), None)
        if attn is not None:
            return HeadGeometry(attn.num_heads, attn.num_kv_heads, attn.head_dim)
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return HeadGeometry(heads, kv, head_dim)
