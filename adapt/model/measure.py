"""What each block computes, read from the numbers: one forward, one block of each structure.

Config names and attribute names are conventions a new model need not follow; the ATen ops its
forward runs are not.  This runs the model once on a short batch (meta tensors for a skeleton) with
every block but one of each distinct structure passed through, and records, per block child:
the attention core's operands (head dim, query heads, value width), the activation ops, a rotation of q and k,
a router's ``topk`` with the scoring op before it, and whether the mask the attention core applies blocks later
positions (read from its values, see ``shadows``).  A block whose forward cannot run on these inputs
(data-dependent control flow on meta tensors) keeps what it recorded before it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from adapt.model.blocks import BlockList
from adapt.model.calls import takes_argument, token_vocab, without_cache
from adapt.model.shadows import Shadows, blocks_future

SEQ = 9  # odd and unlike any width, so the attention product [N, s, d] x [N, d, s] is recognisable
_ACTIVATIONS = {"aten.silu.default": "silu", "aten.relu.default": "relu", "aten.tanh.default": "tanh",
                "aten.sigmoid.default": "sigmoid", "aten.gelu.default": "gelu"}  # fmt: skip
_RECURRENT_OPS = {"aten.exp.default", "aten.cumsum.default", "aten.softplus.default", "aten.logcumsumexp.default"}
_SOFTMAX = ("aten._softmax.default", "aten._safe_softmax.default")
# The batched products an attention core may compute its scores with ([N, s, d] x [N, d, s]); baddbmm also adds its
# first operand (GPT-NeoX-Japanese starts from zeros, BLOOM from its ALiBi bias).
_SCORES_PRODUCTS = ("aten.bmm.default", "aten.baddbmm.default")
_SCORING = {"aten._softmax.default": "softmax", "aten.sigmoid.default": "sigmoid"}


@dataclass
class ChildFacts:
    """What one block child was seen to compute."""

    head_dim: int | None = None
    query_heads: int | None = None
    key_heads: int | None = None
    value_dim: int | None = None
    activations: list[str] = field(default_factory=list)
    top_k: int | None = None
    choices: int | None = None  # what the top-k chose among (the router's width: the number of experts)
    scoring: str | None = None
    convolution: bool = False
    recurrence: bool = (
        False  # exponentials, running sums or a loop over positions: a state (SSM, linear attention, RNN)
    )
    steps: int = 0  # select/slice ops seen: a python loop over the positions runs one per position
    rotation: bool = False  # q or k rotated before the core: rotary position embedding (see _rotates)
    causal: bool | None = None  # the core's mask blocks every later position; None where its values are unknown
    # learned per-head logits in the softmax's denominator: a column beside the keys' scores, or the output rescaled
    # by the scores' logsumexp after it; None: the core was not seen
    sinks: bool | None = None
    # keys times values contracted over the positions into a head-size square: the state of a linear attention
    # (MiniMax's lightning attention), which computes q k^T too but keeps no keys
    kv_state: bool = False
    last_op: str = ""


_PLAIN = (bool, int, float, str, type(None))


def block_signatures(blocks: BlockList) -> list[tuple]:
    """One signature per block: blocks sharing it compute the same kind of thing.

    Class, parameter names and shapes, and the plain attributes of the block and its children (a flag that
    turns rotary off in some layers, a layer kind, a window), so that a layer configured differently is
    measured on its own.  An integer attribute whose value differs in every block is an index (``layer_idx``),
    not a variant, and is left out."""
    attributes = [_plain_attributes(block) for block in blocks.blocks]
    names = {name for found in attributes for name, value in found.items() if type(value) is int}
    indices = {
        name for name in names
        if len(blocks.blocks) > 1 and len({found.get(name) for found in attributes}) == len(blocks.blocks)
    }  # fmt: skip
    return [module_signature(block, found, indices) for block, found in zip(blocks.blocks, attributes)]


def module_signature(
    module: nn.Module, attributes: dict[str, Any] | None = None, ignored: set[str] = frozenset()
) -> tuple:
    """Class, parameter names and shapes, and plain attributes (``ignored`` left out): modules that share it compute
    the same thing."""
    found = _plain_attributes(module) if attributes is None else attributes
    return (
        type(module),
        tuple((n, tuple(p.shape)) for n, p in module.named_parameters()),
        tuple(sorted((k, repr(v)) for k, v in found.items() if k not in ignored)),
    )


def _plain_attributes(block: nn.Module) -> dict[str, Any]:
    return {
        f"{path}.{key}": value
        for path, module in block.named_modules()
        for key, value in vars(module).items()
        if not key.startswith("_") and key != "training" and isinstance(value, _PLAIN)
    }


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.facts: dict[str, ChildFacts] = {}
        self.shadows = Shadows()
        self.scaled_from = WeakTensorKeyDictionary()  # tensor -> the tensor it is a scalar multiple of
        self.sigmoid_of = WeakTensorKeyDictionary()  # a sigmoid's output -> what its input is a scalar multiple of

    def enter(self, name: str) -> None:
        self.stack.append(name)

    def leave(self) -> None:  # a hook's return value replaces the output: this returns None
        if self.stack:
            self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func) in _BF16_ONLY and any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
            out = _in_bf16(func, args, kwargs)
        else:
            out = self.shadows.run(func, args, kwargs)
        if self.stack:
            self._note(self.facts.setdefault(self.stack[-1], ChildFacts()), func, args, kwargs, out)
        return out

    def _note(self, facts: ChildFacts, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        name = str(func)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if "scaled_dot_product" in name and len(tensors) >= 3 and facts.head_dim is None:
            q, k, v = tensors[:3]
            facts.head_dim, facts.query_heads, facts.key_heads, facts.value_dim = (
                q.shape[-1],
                q.shape[1],
                k.shape[1],
                v.shape[-1],
            )
            facts.causal = self._fused_causal(func, args, kwargs, q.shape[-2], k.shape[-2])
            facts.sinks = False  # a fused core has no column beside the keys
        elif name in _SCORES_PRODUCTS and len(tensors) >= 2 and facts.head_dim is None:
            a, b = tensors[-2:]  # baddbmm's first tensor is what it adds: a bias, or zeros scaled away
            if a.dim() == 3 and a.shape[1] == SEQ and b.shape[-1] == SEQ and a.shape[-1] == b.shape[1]:
                facts.head_dim, facts.query_heads = int(a.shape[-1]), int(a.shape[0])
                # Zeros beside the scores: what reaches the softmax beside them is the mask alone.
                self.shadows.set(out, torch.zeros(out.shape, dtype=out.dtype), stand_in=True)
        elif name in _SOFTMAX and facts.head_dim is not None and facts.causal is None and tensors:
            mask = self.shadows.stand_in_of(tensors[0])
            if mask is not None:
                facts.causal = blocks_future(mask, *mask.shape[-2:])
        elif name == "aten.bmm.default" and len(tensors) == 2 and _contracts_positions_only(*tensors):
            facts.kv_state = facts.recurrence = True
        elif (
            name == "aten.bmm.default" and len(tensors) == 2 and facts.head_dim is not None and facts.value_dim is None
        ):
            a, b = tensors
            if a.dim() == 3 and a.shape[-1] == SEQ and b.dim() == 3 and b.shape[1] == SEQ:
                facts.value_dim = int(b.shape[-1])
        elif name == "aten.topk.default" and len(args) > 1 and isinstance(args[1], int):
            facts.top_k = args[1]
            facts.choices = int(args[0].shape[-1]) if isinstance(args[0], torch.Tensor) and args[0].dim() else None
            facts.scoring = _SCORING.get(facts.last_op, facts.scoring)
            if facts.last_op == "aten.sigmoid.default" and facts.activations[-1:] == ["sigmoid"]:
                facts.activations.pop()  # the router's scoring, not the experts' activation
        if name in _SOFTMAX and facts.head_dim is not None and facts.sinks is None and tensors:
            facts.sinks = tensors[0].shape[-1] == SEQ + 1  # the scores of the SEQ keys and one learned column
        elif name == "aten.logsumexp.default" and facts.head_dim is not None:
            facts.sinks = True  # the softmax's denominator read back to rescale the output: a sink applied after it
        if name.startswith("aten.convolution"):
            facts.convolution = True
        facts.steps += name in ("aten.select.int", "aten.slice.Tensor")
        facts.rotation |= facts.head_dim is None and _rotates(name, args)
        if name in _RECURRENT_OPS or facts.steps >= SEQ:  # a decaying state, or a loop over the positions
            facts.recurrence = True
        scores_a_choice = name in _SCORING and facts.top_k is not None and facts.scoring is None
        if name in _ACTIVATIONS and not scores_a_choice:
            label = _ACTIVATIONS[name]
            if label == "gelu" and (kwargs.get("approximate") == "tanh" or "tanh" in args[1:]):
                label = "gelu_tanh"
            facts.activations.append(label)
            if label == "sigmoid" and tensors:
                self.sigmoid_of[out] = self._source(tensors[0])
        if name == "aten.mul.Tensor" and len(args) == 2:
            self._note_product(facts, *args, out)
        if name in _SCORING:
            facts.last_op = name  # the scoring a later topk selects on
            if facts.top_k is not None and facts.scoring is None:  # the choice made on raw logits, scored after it
                facts.scoring = _SCORING[name]

    def _source(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.scaled_from.get(tensor, tensor)

    def _note_product(self, facts: ChildFacts, a: Any, b: Any, out: Any) -> None:
        """A product by a scalar is remembered; ``x * sigmoid(beta x)`` is a swish, SiLU's family (gpt-oss's experts
        with beta 1.702), not a sigmoid activation."""
        scalar = [x for x in (a, b) if not isinstance(x, torch.Tensor) or x.dim() == 0]
        tensors = [x for x in (a, b) if isinstance(x, torch.Tensor) and x.dim() > 0]
        if len(scalar) == 1 and len(tensors) == 1:
            self.scaled_from[out] = self._source(tensors[0])
        elif len(tensors) == 2 and facts.activations[-1:] == ["sigmoid"]:
            for gate, other in (tensors, tensors[::-1]):
                if self.sigmoid_of.get(gate) is self._source(other):
                    facts.activations[-1] = "silu"
                    return

    def _fused_causal(self, func: Any, args: tuple, kwargs: dict, queries: int, keys: int) -> bool | None:
        """A fused attention core's own causal flag, else what its mask blocks (None: the mask has no values)."""
        names = [a.name for a in func._schema.arguments]
        named = {**dict(zip(names, args)), **kwargs}
        if named.get("is_causal"):
            return True
        mask = named.get("attn_mask", named.get("attn_bias"))
        if mask is None:
            return False
        value = self.shadows.value_of(mask)
        return None if value is None else blocks_future(value, queries, keys)


# Ops whose meta kernel accepts bfloat16 only (the grouped GEMM of transformers' default experts): the measurement
# needs their output's shape, which the dtype does not change.
_BF16_ONLY = {"aten._grouped_mm.default"}


def _in_bf16(func: Any, args: tuple, kwargs: dict) -> Any:
    cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args]
    return func(*cast, **kwargs).to(torch.float32)


def _contracts_positions_only(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``[N, d, s] x [N, s, e]``: a product over the positions whose result holds none (``k^T v``)."""
    return a.dim() == 3 and b.dim() == 3 and a.shape[-1] == SEQ == b.shape[1] and SEQ not in (a.shape[1], b.shape[-1])


def _rotates(name: str, args: tuple) -> bool:
    """Per-head q or k rotated (before the attention core, which the caller checks): the sign flip of a half
    rotation, the stride-2 pairs of an interleaved one, a head's upper half taken apart to be rotated (rotary
    written out as ``x1 * cos - x2 * sin``), or its pairs read as complex numbers (rotary as a complex product)."""
    x = args[0] if args else None
    if name == "aten.view_as_complex.default":  # a head's dims read as complex pairs, to be turned by a product
        return isinstance(x, torch.Tensor) and x.dim() == 5
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        return False
    if name == "aten.neg.default":
        return True
    if name != "aten.slice.Tensor" or len(args) < 3 or args[1] not in (-1, 3):
        return False
    width, start, step = x.shape[-1], args[2], args[4] if len(args) > 4 else 1
    return step == 2 or (width % 2 == 0 and start == width // 2)


@contextmanager
def _one_of_each(blocks: BlockList, signatures: list[tuple]) -> Iterator[dict[int, tuple]]:
    """Pass through every block whose structure an earlier block already has; a block that fails passes through too."""
    seen: set[tuple] = set()
    representative: dict[int, tuple] = {}
    saved: list[tuple[nn.Module, Any]] = []  # (block, its own instance-level forward, if it had one)
    last_output: list[Any] = []  # what the latest block that ran returned: the shape a passed-through one answers in
    for index, (block, signature) in enumerate(zip(blocks.blocks, signatures)):
        original = block.forward
        skip = signature in seen
        seen.add(signature)
        if not skip:
            representative[index] = signature
        saved.append((block, block.__dict__.get("forward")))
        block.forward = _guarded(original, skip, last_output)
    try:
        yield representative
    finally:
        for block, own in saved:  # a forward set on the instance (a patch, a wrapper) is put back, not dropped
            if own is None:
                del block.forward
            else:
                block.forward = own


def _guarded(original, skip: bool, last_output: list[Any]):
    def forward(*args, **kwargs):
        hidden = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        if not skip:
            try:
                out = original(*args, **kwargs)
                last_output[:] = [out]
                return out
            except Exception:  # noqa: BLE001 - keep what was recorded; the rest of the model still runs
                pass
        return _passed_through(hidden, last_output[0] if last_output else None)

    return forward


def _passed_through(hidden: torch.Tensor, like: Any) -> Any:
    """``hidden`` in the form blocks return: bare, or first in a tuple beside what the last block that ran returned
    with it (a layer handing its successor a state, as Kolibri's index pool; a model unpacks every block's tuple)."""
    if isinstance(like, tuple) and like and isinstance(like[0], torch.Tensor):
        return (hidden, *like[1:])
    return hidden


def measure_blocks(model: nn.Module, blocks: BlockList, signatures: list[tuple]) -> dict[tuple, dict[str, ChildFacts]]:
    """Per block signature (``block_signatures``, taken before any forward: a model may reconfigure its blocks while
    running), the facts of each of its direct children (by child name)."""
    recorder = _Recorder()
    handles = []
    for block in blocks.blocks:
        for name, child in block.named_children():
            handles.append(child.register_forward_pre_hook(lambda m, a, n=name: recorder.enter(n)))
            handles.append(child.register_forward_hook(lambda m, a, o: recorder.leave()))
    by_block: dict[tuple, dict[str, ChildFacts]] = {}
    try:
        with _one_of_each(blocks, signatures) as representative:
            device = next(model.parameters()).device
            vocab = token_vocab(model)
            chosen = torch.randint(0, vocab, (1, SEQ))
            ids = chosen.to(device)
            recorder.shadows.set(ids, chosen)
            inputs = {"input_ids": ids}
            if takes_argument(model, "attention_mask"):
                # Every token real, said outright: a model then never inspects the ids for padding (``.item()``
                # on a tensor built from a Python list, whose values the meta device cannot know).
                inputs["attention_mask"] = torch.ones_like(ids)
                recorder.shadows.set(inputs["attention_mask"], torch.ones_like(chosen))
            # Caches as the model sets them up by default (without one, masks may read positions with .item(),
            # which meta tensors refuse); then without, for layers whose caches only their own generate() builds.
            uncached = without_cache(model)
            attempts = [{}, uncached] if uncached else [{}]
            for index in representative:
                handles.append(blocks.blocks[index].register_forward_hook(
                    lambda m, a, o, i=index: _harvest(recorder, by_block, representative[i])))  # fmt: skip
            for extra in attempts:
                try:
                    with torch.no_grad(), recorder:
                        model(**inputs, **extra)
                    break
                except Exception:  # noqa: BLE001 - a model that cannot run here is described from shapes alone
                    recorder.facts, recorder.stack = {}, []
    finally:
        for handle in handles:
            handle.remove()
    _fill_unreached_children(blocks, signatures, by_block)
    return by_block


def _fill_unreached_children(
    blocks: BlockList, signatures: list[tuple], by_block: dict[tuple, dict[str, ChildFacts]]
) -> None:
    """A child its block never reached (an earlier child raised here: data-dependent code on meta tensors) takes the
    facts of the same child measured in another block: the same class, parameter shapes and plain attributes
    compute the same thing."""
    seen: dict[tuple, ChildFacts] = {}
    for block, signature in zip(blocks.blocks, signatures):
        for name, facts in by_block.get(signature, {}).items():
            seen.setdefault(module_signature(block.get_submodule(name)), facts)
    for block, signature in zip(blocks.blocks, signatures):
        if signature not in by_block:
            continue
        for name, child in block.named_children():
            found = seen.get(module_signature(child))
            if name not in by_block[signature] and found is not None:
                by_block[signature][name] = found


def _harvest(recorder: _Recorder, by_block: dict[tuple, dict[str, ChildFacts]], signature: tuple) -> Any:
    by_block.setdefault(signature, {}).update(recorder.facts)
    recorder.facts = {}
    recorder.stack.clear()
    return None
