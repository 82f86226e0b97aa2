"""The one answer to "which modules are the model's repeated blocks?".

Intake, the operators stage, alignment and the runtime's parallelisation all call ``find_blocks``,
so a model that defeats it defeats it everywhere, visibly, in one place.

The rule, by structure only (no class names, no ``model_type``):
- a candidate is an ``nn.ModuleList`` or ``nn.Sequential`` whose every entry is *composite* (it owns
  parameters in at least two child modules): a list of leaf norms or embeddings is not a block list;
- a candidate nested inside another candidate's entries is a part of a block (experts kept as a list
  of MLPs, per-layer sub-lists), never the block list itself, however long it is;
- entries may be of several classes: hybrid stacks that alternate attention with recurrent or
  convolutional mixers are one block list;
- among the outermost candidates, the ones nearest the input embedding in the module tree come first
  (a multimodal or encoder-decoder model holds a vision or audio stack beside the one its tokens run
  through, which may be the larger at a given size), and of those the one holding the most parameters wins.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn


@dataclass
class BlockList:
    """The repeated blocks of a model and where they live."""

    path: str  # e.g. "model.layers"
    blocks: list[nn.Module]

    def block_path(self, index: int) -> str:
        return f"{self.path}.{index}" if self.path else str(index)

    def named(self) -> list[tuple[str, nn.Module]]:
        return [(self.block_path(i), block) for i, block in enumerate(self.blocks)]

    def classes(self) -> list[str]:
        """Distinct block classes in order of first appearance (more than one for a hybrid stack)."""
        return list(dict.fromkeys(type(b).__name__ for b in self.blocks))

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.blocks)

    def __getitem__(self, index: int) -> nn.Module:
        return self.blocks[index]


class NoBlockList(ValueError):
    """The module tree holds no list of composite modules: the model has no repeated blocks to find."""


def _is_composite(module: nn.Module) -> bool:
    owners = 0
    for child in module.children():
        if any(True for _ in child.parameters()):
            owners += 1
            if owners >= 2:
                return True
    return False


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = []
    for path, module in model.named_modules():
        listed = isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 0
        if listed and all(_is_composite(entry) for entry in module):
            found.append((path, module))
    return found


def find_blocks(model: nn.Module) -> BlockList:
    """The model's repeated blocks (see the module docstring for the rule); ``NoBlockList`` if none."""
    stacks = block_stacks(model)
    if not stacks:
        raise NoBlockList("no repeated block list (a ModuleList of layers, each with several parametric parts) found")
    return stacks[0]


def block_stacks(model: nn.Module) -> list[BlockList]:
    """Every outermost repeated stack, ranked by the module docstring's rule: the first is ``find_blocks``'s answer,
    the others are stacks beside it (a vision tower, or a byte-level model's global transformer and local decoder
    beside its local encoder), which a description of the first alone leaves out."""
    candidates = _candidates(model)
    outer = [
        (path, module)
        for path, module in candidates
        if not any(other != path and (other == "" or path.startswith(other + ".")) for other, _ in candidates)
    ]
    embedding = _input_embedding_path(model)

    def rank(item: tuple[str, nn.Module]) -> tuple[int, int, int]:
        distance = _tree_distance(item[0], embedding) if embedding is not None else 0
        return -distance, sum(p.numel() for p in item[1].parameters()), len(item[1])

    return [BlockList(path=path, blocks=list(module)) for path, module in sorted(outer, key=rank, reverse=True)]


def stacks_beside(model: nn.Module, described: BlockList) -> list[tuple[BlockList, int]]:
    """The stacks other than ``described`` that hold parameters, each with its parameter count, in rank order."""
    others = [s for s in block_stacks(model) if s.path != described.path]
    sized = [(s, sum(p.numel() for block in s.blocks for p in block.parameters())) for s in others]
    return [(s, n) for s, n in sized if n]


def _input_embedding_path(model: nn.Module) -> str | None:
    """Where the token embedding lives, when the model names it (``get_input_embeddings``)."""
    try:
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except (NotImplementedError, AttributeError):
        return None
    if embedding is None:
        return None
    return next((path for path, module in model.named_modules() if module is embedding), None)


def _tree_distance(a: str, b: str) -> int:
    """Edges between two modules of one tree, given their dotted paths ("" is the root)."""
    left, right = (a.split(".") if a else []), (b.split(".") if b else [])
    shared = 0
    while shared < min(len(left), len(right)) and left[shared] == right[shared]:
        shared += 1
    return len(left) + len(right) - 2 * shared


def is_expert_list(module: nn.Module) -> bool:
    """Experts kept as a list of separate modules: two or more of one class, holding only 2-D weights."""
    if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(m) for m in module}) != 1:
        return False
    shapes = [tuple(p.shape) for p in module[0].parameters()]
    return len(shapes) >= 2 and all(len(s) == 2 for s in shapes)


_WIDTH_NAMES = ("hidden_size", "d_model", "n_embd", "dim", "model_dim")


def residual_width(model: nn.Module) -> int:
    """The width of the residual stream the blocks read and write, which may differ from the embedding's.

    A config width name is taken when the first block's weights carry that size; otherwise the size that
    the first block's weights carry most often (every projection in or out of the stream has it); the
    embedding width only for a model without blocks.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embed_width = int(embedding.weight.shape[-1]) if embedding is not None else 0
    try:
        first = find_blocks(model).blocks[0]
    except NoBlockList:
        return embed_width
    counts: dict[int, int] = {}
    for p in first.parameters():
        if p.dim() in (1, 2):
            for size in set(p.shape):
                counts[int(size)] = counts.get(int(size), 0) + 1
    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)] if config is not None else []
    for cfg in configs:
        for name in _WIDTH_NAMES:
            value = getattr(cfg, name, None) if cfg is not None else None
            if isinstance(value, int) and value in counts:
                return value
    if embed_width in counts:
        return embed_width
    return max(counts, key=lambda size: (counts[size], size)) if counts else embed_width
